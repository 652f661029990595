"""Emulated links: Gloo ranks inside a private network namespace whose loopback is shaped by tbf.

    with ShapedLink(rate_gbps=1.0) as link:            # needs root, ip and tc; else EmulationUnavailable
        results = launch_ranks("gradcomp.emulate:train_worker", 2, config, link=link)

Four parts: ``links`` shapes the network (ShapedLink: one namespace whose loopback is shaped;
ShapedNodes: two namespaces joined by a shaped veth pair), ``launch`` runs
``module:function(rank, world_size, config) -> JSON-able`` on Gloo ranks (``python -m
gradcomp.emulate`` starts each), ``train`` holds the workloads and the training worker of the
validation runs, ``quality`` the calibration of a workload's quality under each hook
(``calibrate_quality``: ``gradcomp calibrate --quality``). The public names of the first three
are importable from here.
"""
from .launch import KEEP_FREED_MEMORY, free_port, launch_ranks
from .links import LOOPBACK, EmulationUnavailable, ShapedLink, ShapedNodes, unavailable_reason
from .train import HOOK_STAGES, WORKLOADS, attach_hook, classification_loss, hook_options, median_step_s, mlp, \
    node_groups, timed_training, train_worker, workload

__all__ = ["KEEP_FREED_MEMORY", "free_port", "launch_ranks", "LOOPBACK", "EmulationUnavailable", "ShapedLink", "ShapedNodes",
           "unavailable_reason", "HOOK_STAGES", "WORKLOADS", "attach_hook", "classification_loss", "hook_options",
           "median_step_s", "mlp", "node_groups", "timed_training", "train_worker", "workload"]
