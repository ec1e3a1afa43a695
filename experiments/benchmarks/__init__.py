"""The libraries of the benchmark programs (programs/benchmarks/): the actors' generate-call
log (generate_log.py) and the equal-wall-clock curve math (budget_curves.py)."""
