"""Send five arrays on channel 'first', then end the stream (leaving the block ends it)."""

import numpy as np

from hurray_ipc import Producer

with Producer(channel="first") as p:
    for i in range(5):
        # send() waits (here up to 30 s) until a consumer asks for a buffer; once the buffer
        # left, it waits for the broker's answer without that bound (a retry would send it twice)
        p.send(np.full((2, 3), i, dtype=np.float32), meta={"frame": i}, timeout=30)
