"""Run-time diagnosis: classify worker faults, notice hangs and stragglers, gate rounds on
health checks. The agent watches, the master decides (:mod:`planaria.master.job`)."""
