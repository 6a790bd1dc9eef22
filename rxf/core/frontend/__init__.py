"""The main process's side of the engine (the HTTP server's, or the `Runtime` caller's): requests
prepared once (`request_preparer`), submitted and answered (`tokenizer_manager`), routed to a
data-parallel replica (`dp_router`), and returned as typed outputs (`outputs`)."""
