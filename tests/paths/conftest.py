from tests.paths._pass import matrix_pass

__all__ = ["matrix_pass"]
