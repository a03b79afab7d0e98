"""A no-op inbound handler for the harness's inbound scenario (bench/run.py sets
``INGEST_HANDLER_MODULES=bench.inbound_noop`` for the pipeline it starts)."""

from ingest.handlers import ParsedEvent, handler


@handler("benchin", "*")
def noop(event: ParsedEvent) -> None:
    """Does nothing: what is measured is the receive path and the processing around it."""
