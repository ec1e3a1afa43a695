"""Choosing a staleness limit: a planner that simulates the actor-learner loop with the
program's own admission, queue and drop rules (planner.py, fed by inputs.py), a tuner that
measures short runs over a grid of limits (tuner.py), the rule that recommends one
(recommend.py), their reports (report.py) and the planner's validation against measured runs
(validation.py). docs/STALENESS.md is the guide."""
