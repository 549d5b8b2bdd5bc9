"""Scenarios on a real node: a real kubelet v1.36.2 with its own containerd (``node.sh`` of ``../shared/k8s``), the
csi-driver-host-path node plugin and node-driver-registrar as a DaemonSet that the real kube-controller-manager
rolls out, in front of the guard. What these tests prove is what the kubelet itself *decides*: when its plugin
watcher registers a driver, what its periodic NodeGetInfo loop (KEP-4876) writes and how often, and how it reacts
to a count the guard clamped. Where a test needs a count at a chosen moment, the suite's ``kubelet-csinode`` tests
(``tests/k8s``) make kubelet's writes instead.
"""
