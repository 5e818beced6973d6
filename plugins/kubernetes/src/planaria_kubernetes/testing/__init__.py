"""An emulated Kubernetes cluster for tests (see :mod:`planaria_kubernetes.testing.cluster`)."""
