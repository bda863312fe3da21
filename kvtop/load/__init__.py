"""`kvtop load`: a recorded trace's (or a workload's) traffic as a plan, and the client that sends it."""
