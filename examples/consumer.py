"""Print each array of channel 'first'; the loop ends once its producers ended their stream."""

from hurray_ipc import Consumer

with Consumer(channel="first") as c:
    for h in c:
        with h:  # the buffer goes back to the producer at the end of the block
            print(h.meta["frame"], h.numpy().tolist())
