"""The run report (``areal report``) and sample inspection (``areal inspect``).

``rundir`` reads what a run directory holds, tolerating runs that are still
going, were cut short or come from older versions; ``panels`` says which
metrics each plot of the report shows; ``html`` draws them (matplotlib, imported
only there) into one self-contained page; ``inspect_step`` prints one step's
samples. Importing this package imports none of them.
"""
