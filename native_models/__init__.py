"""The embedding model's builder (``build.py``); the built files live outside the package."""
