"""nvchat's Textual app."""
from nvchat.app.app import NvchatApp

__all__ = ["NvchatApp"]
