import os
import sys

# make `tests.support` importable as `support` too, whatever the rootdir
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
