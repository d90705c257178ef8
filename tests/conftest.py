"""Helpers shared by test folders (tests/helpers) are imported by module name, like each folder's own."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers"))
