"""`python -m nvchat`: the `nvchat` executable, for an environment whose scripts folder is not on PATH."""
import sys

from nvchat.cli import command

sys.exit(command())
