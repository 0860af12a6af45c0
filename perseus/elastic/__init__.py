"""Elastic jobs: the wire format shared by the launcher's driver, the ranks and the checkpoint keepers
(:mod:`perseus.elastic.wire`), the keepers that hold committed state in host memory
(:mod:`perseus.elastic.keeper`), the ranks' side of the Gemini checkpoint store (:mod:`perseus.elastic.gemini`)
and of the driver connection (:mod:`perseus.elastic.worker`). See docs/elastic.md.
"""
