"""Built-in rendezvous backends."""
