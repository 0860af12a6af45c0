"""Elastic jobs (``perseusrun --host-discovery-script``; docs/elastic.md).

The launcher's driver, discovery script and checkpoint keepers are in :mod:`perseus.runner.elastic`. Here:
:mod:`perseus.elastic.ranks` (the driver's server for its ranks), and the ranks' side:
:mod:`perseus.elastic.worker` (the driver connection, leaving, re-forming in process),
:mod:`perseus.elastic.gemini` (copies of each commit, placement, retrieval) and :mod:`perseus.elastic.shm`
(snapshot buffers in shared memory). :mod:`perseus.elastic.protocol` is the message format they all speak.
"""
