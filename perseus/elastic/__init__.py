"""Elastic jobs (``perseusrun --host-discovery-script``; docs/elastic.md).

The launcher's driver (with its server for the ranks), discovery script and checkpoint keepers are in
:mod:`perseus.runner.elastic`. Here, the ranks' side: :mod:`perseus.elastic.state` (the ``State`` objects and
the ``run`` loop), :mod:`perseus.elastic.worker` (the driver connection, leaving, re-forming in process),
:mod:`perseus.elastic.gemini` (copies of each commit, placement, retrieval) and :mod:`perseus.base.elastic_shm`
(snapshot buffers in shared memory). :mod:`perseus.base.elastic_protocol` is the message format they all speak.
"""
