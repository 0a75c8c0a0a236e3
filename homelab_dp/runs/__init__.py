"""The run contract: the spec the worker reads, events, views, the queue, results."""
