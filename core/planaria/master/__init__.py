"""The job master: one per job. Owns the job's state, rendezvous rounds and fault policy."""
