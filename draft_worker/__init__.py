"""Draft worker: Celery tasks that drive sessions (draft, send, apply verdict, adapt gamma)."""
