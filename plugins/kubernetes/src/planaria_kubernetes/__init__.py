"""planaria's ``kubernetes`` scheduler: the master creates one pod per node itself, watches
them, and replaces a lost one away from its bad host (see
:mod:`planaria_kubernetes.scheduler`)."""

from planaria_kubernetes.options import KubernetesOptions, OwnerRef
from planaria_kubernetes.scheduler import KubernetesScheduler

__all__ = ["KubernetesOptions", "KubernetesScheduler", "OwnerRef"]
