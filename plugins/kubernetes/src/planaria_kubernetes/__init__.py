"""planaria's ``kubernetes`` scheduler: the master creates one pod per node itself, watches
them, and replaces a lost one away from its bad host."""
