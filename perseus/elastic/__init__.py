"""Elastic jobs (``perseusrun --host-discovery-script``; docs/elastic.md).

The launcher's side: :mod:`perseus.elastic.driver` (generations, failures, host changes),
:mod:`perseus.elastic.discovery` (the discovery script, the blacklist), :mod:`perseus.elastic.ranks` (the
driver's server for its ranks) and :mod:`perseus.elastic.keeper` (one checkpoint keeper per host, commits in
memory). The ranks' side: :mod:`perseus.elastic.worker` (the driver connection, leaving, re-forming in
process), :mod:`perseus.elastic.gemini` (copies of each commit, placement, retrieval) and
:mod:`perseus.elastic.shm` (snapshot buffers in shared memory). :mod:`perseus.elastic.protocol` is the message
format they all speak.
"""
