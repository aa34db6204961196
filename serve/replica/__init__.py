"""The engine replica: the Ray Serve deployment that owns one engine process, shared by trials and production."""
