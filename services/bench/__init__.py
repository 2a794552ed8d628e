"""`mirror-sd bench`: one prompt set through several decoding modes, side by side."""
