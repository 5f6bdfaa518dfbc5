"""autopar from Python: the planner as a library (`autopar.api.search`) and its report (`autopar.api.report`), which the
command line's ``autopar plan`` calls."""
