"""The production endpoint's half of the closed loop (pipeline/loop/ is the other): live figures, traffic capture, the
candidate arm of a canary, and the control routes' contract."""
