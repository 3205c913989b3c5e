"""Test support shipped with the kernel: pytest fixtures and contract suites.

Backend plugins (ours and third parties') subclass the contract classes in
``areal_kernel.testing.contracts`` and provide the fixtures they ask for; the
pytest plugin (entry point ``areal_testing``) supplies shared fixtures.
"""
