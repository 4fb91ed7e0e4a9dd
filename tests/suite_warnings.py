"""Warning classes the suite's tests emit, in a module that pytest-xdist's controller can
import: it re-creates a worker's warning by importing the class's module by name, and a class
defined in a test module (``test_golden``, importable only on the workers) ended the whole
session with ``INTERNALERROR ... No module named 'test_golden'``."""


class GoldenNotRecorded(UserWarning):
    """No golden recording for this machine's floating-point environment (test_golden.py)."""
