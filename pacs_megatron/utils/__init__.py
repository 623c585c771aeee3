"""Small shared helpers: logging, timing, files."""
