"""The HTTP surface: the routes and their bodies. It calls the rooms below; nothing below imports it."""
