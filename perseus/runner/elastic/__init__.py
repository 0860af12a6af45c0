"""The launcher's side of elastic jobs (``perseusrun --host-discovery-script``; docs/elastic.md).

These modules run in the ``perseusrun`` process, or, for the keeper, in a process of its own that the
launcher starts on every host; none of them runs in a training rank. :mod:`~perseus.runner.elastic.driver`
runs the generations and reacts to failures and host changes (its server for the ranks is
:mod:`~perseus.runner.elastic.ranks`), :mod:`~perseus.runner.elastic.discovery` runs
the discovery script and keeps the blacklist, :mod:`~perseus.runner.elastic.keeper_process` starts the
checkpoint keepers and :mod:`~perseus.runner.elastic.keeper` is the keeper process itself (commits in
memory). The ranks' side, and the message format both sides speak, are in :mod:`perseus.elastic`.
"""
