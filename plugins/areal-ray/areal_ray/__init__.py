"""areal-ray: the ``ray`` scheduler (``scheduler.type: ray``)."""
