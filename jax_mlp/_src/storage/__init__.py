"""Storage: records, host buffers, the host cache, traffic control, chunk files, paths and the tier stack.

The rooms import downwards only (record and buffers at the bottom, the tier stack on top) and never
call up into the offloader: fields go in and come out, and :class:`record.RecordCodec` is the one
place that knows how fields become bytes.
"""
