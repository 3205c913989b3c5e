"""The single-controller trainer loop (``areal train``) and the dry run (``areal check``)."""
