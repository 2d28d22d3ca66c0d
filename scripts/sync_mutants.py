"""Sabotage one rule at a time and show the suite catches each (scripts/check-sync-mutants).

Each mutant turns one step of the sync contract (or of the give-back and end-of-stream rules)
into a no-op in a copy of the tree; the tests then run against that copy (PYTHONPATH, so spawned
workers and the broker import it too). A mutant that no test catches is a hole in the suite: the
script exits 1.

The copy is checked to be the code under test: the script refuses to run when the copy's modules do
not import from the copy (an editable install's finder could otherwise win over PYTHONPATH).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest_workers  # scripts/, beside this file

ROOT = Path(__file__).resolve().parent.parent
TESTS = ["tests/test_races.py", "tests/test_paths.py", "tests/test_clients.py", "tests/test_devices.py",
         "tests/test_stress.py"]

# The stress workload's mixed paths (tests/test_stress.py) break on the same mutants: stress, not
# only the targeted tests, catches them.
PATHS = ["tests/test_paths.py", "tests/test_stress.py::test_stress_mixed_paths_are_clean"]
GIVE_BACK = ["tests/test_give_back.py"]
END_OF_STREAM = ["tests/test_end_of_stream.py"]
GPU_READABLE = ["tests/test_gpu_readable.py"]
KEPT = ["tests/test_kept_mappings.py", "tests/test_kept_mappings_processes.py"]
THREADS = ["tests/test_client_threads.py"]
FENCING = ["tests/test_fencing.py", "tests/test_broker_core.py", "tests/test_end_of_stream.py::test_vector_on_the_core"]

# name -> (file, the exact text of the step, what replaces it[, the tests to run; default TESTS])
MUTANTS: dict[str, tuple[str, ...]] = {
    "stream-wait": ("hurray_ipc/devices/cuda.py",
                    "        self.device.rt.stream_wait_event(self.raw, event._live())\n",
                    "        pass  # MUTANT: no stream-wait\n"),
    "event-record": ("hurray_ipc/devices/cuda.py",
                     "        self.device.rt.event_record(self._live(), stream.raw)\n",
                     "        pass  # MUTANT: no event record\n"),
    "producer-host-wait": ("hurray_ipc/client/producer.py",
                           "        if mode is SyncMode.PRODUCER_SYNCED:\n            stream.synchronize()\n",
                           "        if mode is SyncMode.PRODUCER_SYNCED:\n            pass  # MUTANT: no host wait\n"),
    # The library's release-after-work: ReceivedHandoff.release() fences the consumer's streams
    # and sends RELEASE only once those fences completed. The mutant sends it at once.
    "release-after-work": ("hurray_ipc/client/consumer.py",
                           "        self._consumer._release_after(self, fences)\n",
                           "        self._consumer._release_after(self, [])  # MUTANT: early RELEASE\n"),
    # release_many (issue 24): a batch's RELEASEs leave together, each still after its own fences.
    "release-many-unfenced": ("hurray_ipc/client/consumer.py",
                              "            for h in batch:\n                h.release(fence)\n",
                              "            for h in batch:  # MUTANT: the batch released without its fences\n"
                              "                h._release_streams = []\n"
                              "                super(ReceivedHandoff, h).release()\n",
                              "tests/test_paths.py"),
    # Issue 22's library mutants that no test caught before.
    "release-fences-own-stream": ("hurray_ipc/client/consumer.py",
                                  "        for s in self._waited + [self.consumer_stream, self._consumer.stream]:\n",
                                  "        for s in [self.consumer_stream, self._consumer.stream]:  # MUTANT\n",
                                  *PATHS),
    "release-last-fence": ("hurray_ipc/client/core.py",
                           "        e.fences = set(fences)\n",
                           "        e.fences = set(list(fences)[-1:])  # MUTANT: last recorded, last done\n",
                           *PATHS, "tests/test_client_core.py"),
    "synced-own-stream": ("hurray_ipc/client/producer.py",
                          "        if mode is SyncMode.PRODUCER_SYNCED:\n            stream.synchronize()\n",
                          "        if mode is SyncMode.PRODUCER_SYNCED:\n"
                          "            (self.stream or stream).synchronize()  # MUTANT: not the writing stream\n",
                          *PATHS),
    "release-before-unmap": ("hurray_ipc/client/core.py",
                             "        return unmap + [release] + self._inbox_shrank()\n",
                             "        return [release] + self._inbox_shrank() + unmap  # MUTANT: unmapped late\n",
                             *PATHS, "tests/test_client_core.py"),
    # The host-staged fallback: the consumer reads the slot on its host (checker limit C, removed).
    "staged-no-host-wait": ("hurray_ipc/client/producer.py",
                            "        s.synchronize()\n        s.device.publish_host(",
                            "        s.device.publish_host(  # MUTANT: the staged copy is not host-waited\n",
                            "tests/test_clients.py", *PATHS),
    "event-destroyed-early": ("hurray_ipc/client/producer.py",
                              "and pool is not None and pool.pooled and self._writes_done(o):\n",
                              "and pool is not None and self._writes_done(o):  # MUTANT: destroyed early\n",
                              "tests/test_clients.py"),
    # The real backend leaves the application's CUDA state as it found it (issue 22).
    "device-not-restored": ("hurray_ipc/devices/cuda.py",
                            "        if prev is not None:\n            self.rt.set_device(prev)\n",
                            "        pass  # MUTANT: the caller's device stays switched\n",
                            "tests/test_devices.py"),
    "not-ready-not-cleared": ("hurray_ipc/devices/backend/real.py",
                              "            self.rt.cudaGetLastError()  # this runtime's own",
                              "            pass  # MUTANT: the NotReady stays the last error; this runtime's own",
                              "tests/test_devices.py"),
    "probe-caches-transient": ("hurray_ipc/devices/backend/real.py",
                               "        if not transient:\n",
                               "        if True:  # MUTANT: a transient failure is kept for good\n",
                               "tests/test_devices.py"),
    # A failed send gives back what it took (issue 21): each mutant drops one give-back.
    "give-back-grant": ("hurray_ipc/client/producer.py",
                        "                        self.grants.give_back(grant)  # unused: the next send takes it\n",
                        "                        pass  # MUTANT: the grant of a failed send is lost\n", *GIVE_BACK),
    "give-back-many-grants": ("hurray_ipc/client/producer.py",
                              "                        for g in reversed(grants[len(batch):]):\n"
                              "                            self.grants.give_back(g)\n",
                              "                        pass  # MUTANT: send_many keeps the grants it did not use\n",
                              *GIVE_BACK),
    "give-back-prepared": ("hurray_ipc/client/producer.py",
                           "            self._undo(out, failed=True)\n            raise\n        msg.handle =",
                           "            raise  # MUTANT: a failed preparation keeps slot, event\n        msg.handle =",
                           *GIVE_BACK),
    "give-back-submit": ("hurray_ipc/client/producer.py",
                         "                    self._undo(out, failed=True)\n"
                         "                    self.grants.give_back(out.grant)\n",
                         "                    pass  # MUTANT: an unsent handoff keeps its grant and resources\n",
                         *GIVE_BACK),
    "whole-refusal-ids": ("hurray_ipc/wire/ipc.py",
                          "                e.extra.setdefault(\"handoff_ids\",",
                          "                (lambda *a: None)(\"handoff_ids\",  # MUTANT: the ERROR names no handoff\n",
                          *GIVE_BACK),
    "whole-refusal-regrant": ("hurray_ipc/client/producer.py",
                              "                    self.grants.give_back(o.grant)\n",
                              "                    pass  # MUTANT: the unused grant of a refused message is lost\n",
                              *GIVE_BACK),
    "whole-refusal-ready": ("hurray_ipc/client/producer.py",
                            "                    self.credits.answered(o.ready)",
                            "                    pass  # MUTANT: the refused message's READY still counted",
                            *GIVE_BACK),
    "refusal-rematch": ("hurray_ipc/broker/core.py",
                        "            self._match(g.channel)\n            raise\n",
                        "            raise  # MUTANT: the returned credit waits for an unrelated REQUEST/READY\n",
                        *GIVE_BACK, "tests/test_broker_core.py"),
    # End of stream (ipc-protocol.md 4.9).
    "eos-never-ends": ("hurray_ipc/broker/core.py",
                       "        if all(self.clients[p].ended for p in ch.producers):\n",
                       "        if False:  # MUTANT: the stream never ends\n", *END_OF_STREAM),
    "eos-crash-ends": ("hurray_ipc/broker/core.py",
                       "            self._producer_gone(list(self.handed_by.get(rid, {}).values()))\n",
                       "            self._producer_gone(list(self.handed_by.get(rid, {}).values()))\n"
                       "            self.on_end(c)  # MUTANT: a producer's death ends the stream\n",
                       *END_OF_STREAM),
    "eos-end-keeps-grants": ("hurray_ipc/broker/core.py",
                             "        c.ended = True\n        self._return_grants(c)\n",
                             "        c.ended = True  # MUTANT: the ended producer's grants are not returned\n",
                             *END_OF_STREAM),
    "eos-before-inbox": ("hurray_ipc/client/session.py",
                         "            if queue:\n                got.append(queue.popleft() if take_next",
                         "            if stop is not None and stop():  # MUTANT: the end before what is queued\n"
                         "                stopped.append(True)\n                return True\n"
                         "            if queue:\n                got.append(queue.popleft() if take_next",
                         *END_OF_STREAM),
    "eos-close-bounded": ("hurray_ipc/client/producer.py",
                          "                    self.flush(None if timeout is None else max(0.0, timeout - 0.5))\n",
                          "                    self.flush(4.5 if timeout is None else max(0.0, timeout - 0.5))\n",
                          *END_OF_STREAM),
    "eos-end-leaves-send-waiting": ("hurray_ipc/client/producer.py",
                                    "                                  stop=lambda: self.ended)\n",
                                    "                                  stop=None)\n",
                                    *END_OF_STREAM),
    "eos-restart-forgets": ("hurray_ipc/client/core.py",
                            '"credits": self.credits.asked, "ended": self.ended}',
                            '"credits": self.credits.asked, "ended": False}  # MUTANT: a new broker is not told',
                            *END_OF_STREAM),
    # A received GPU buffer read without a framework: the copy is ordered after the producer.
    "copy-to-host-unordered": ("hurray_ipc/client/consumer.py",
                               "        s = self._handoff.ordered_stream() or self._handoff.order_onto(",
                               "        s = self._handoff._consumer.gpu.create_stream() or (",  # MUTANT: unordered
                               *GPU_READABLE),
    "stream-copy-unordered": ("hurray_ipc/client/consumer.py",
                              "        if not self.on_host:\n            self._handoff.order_onto(stream)\n",
                              "        pass  # MUTANT: the copying stream is not ordered after the producer\n",
                              *GPU_READABLE),
    # Broker restart (ipc-protocol.md 6): a claim made before its producer returns binds at once,
    # so the first claimant shuts the real holder out and the producer gets it back while read.
    "claim-first-binds": ("hurray_ipc/broker/core.py",
                          "            if producer is not None:\n"
                          "                if named is None or named == c.label:\n",
                          "            if True:  # MUTANT: a claim binds before its producer decides\n"
                          "                if named is None or named == c.label:\n",
                          "tests/test_broker_core.py"),
    # Fairness (ipc-protocol.md 4.3, 4.3a): credits served per credit, not per consumer, so a
    # greedy consumer (4096 credits, never reading) takes every grant while others starve.
    "credits-fifo": ("hurray_ipc/broker/core.py",
                     "            if consumer.credits:\n"
                     "                ch.requests.move_to_end(consumer_rid)\n",
                     "            if consumer.credits:\n"
                     "                pass  # MUTANT: the same consumer stays at the front\n",
                     "tests/test_broker_core.py"),
    # The pair's valid modes (transport/pairing.py ModeCache): the broker checks each declared
    # mode against them and the producer chooses from them. An identity fast path that forgets
    # one side of the pair serves another pair's answer, e.g. EVENT to a consumer without events.
    "mode-cache-no-consumer": ("hurray_ipc/transport/pairing.py",
                               "        ids = (id(producer), id(consumer))\n",
                               "        ids = (id(producer), 0)  # MUTANT: any consumer's answer\n",
                               "tests/test_mode_cache.py", "tests/test_broker_core.py"),
    "mode-cache-no-producer": ("hurray_ipc/transport/pairing.py",
                               "        ids = (id(producer), id(consumer))\n",
                               "        ids = (0, id(consumer))  # MUTANT: any producer's answer\n",
                               "tests/test_mode_cache.py", "tests/test_broker_core.py"),
    # An identity entry that does not hold its endpoints lets a freed id name another endpoint.
    "mode-cache-ids-unheld": ("hurray_ipc/transport/pairing.py",
                              "            self._by_id[ids] = (producer, consumer, pm)\n",
                              "            self._by_id[ids] = (None, None, pm)  # MUTANT: ids not held\n",
                              "tests/test_mode_cache.py"),
    # A producer that asks and never sends keeps the only credit: no revocation on contention.
    "grant-never-revoked": ("hurray_ipc/broker/core.py",
                            "        self._revoke(oldest)\n"
                            "        return True\n",
                            "        return False  # MUTANT: an idle grant is never taken back\n",
                            "tests/test_broker_core.py", "tests/test_broker_attacks.py"),
    # Choked consumers (ipc-protocol.md 1): once a send to a consumer failed, none of its credits
    # is granted until a probe gets through, or each handoff granted to it bounces back to its
    # producer `undelivered: full`; and the choke ends only when a probe got through.
    "choke-never": ("hurray_ipc/broker/core.py",
                    '        if c is not None and c.role == "consumer" and why in ("full", "unreachable"):\n'
                    "            self._choke(c)\n",
                    "        pass  # MUTANT: its credits stay queued\n",
                    "tests/test_broker_core.py",
                    "tests/test_broker_attacks.py::test_a_peer_that_stops_reading_is_counted_and_granted_nothing_"
                    "until_it_reads_again"),
    # Peers not registered (ipc-protocol.md 6a): past the byte budget they share, two small
    # messages a second of each routing id are still read, so a newcomer registers during a flood;
    # the bound per routing id, and the debt's floor, keep that from reopening the flood.
    "newcomer-dropped": ("hurray_ipc/broker/core.py",
                         "        if size > NEWCOMER_BYTES:\n            return False\n",
                         "        if True:  # MUTANT: past the budget everything is dropped\n"
                         "            return False\n",
                         "tests/test_broker_core.py"),
    "newcomer-unbounded": ("hurray_ipc/broker/core.py",
                           "        if allowance < 1.0:\n            return False\n",
                           "        if False:  # MUTANT: every small message passes the budget\n"
                           "            return False\n",
                           "tests/test_broker_core.py"),
    "unregistered-debt-unfloored": ("hurray_ipc/broker/core.py",
                                    "        b[0] = min(b[0], max(b[0] - size, -UNREGISTERED_BYTES))\n",
                                    "        b[0] -= size  # MUTANT: a newcomer flood leaves unbounded debt\n",
                                    "tests/test_broker_core.py"),
    # A drain round ends at one peer's 8th message (ipc-protocol.md 1), or one client's PINGs hold
    # every other answer for the round's 2 ms.
    "round-peer-unbounded": ("hurray_ipc/broker/server.py",
                             "ROUND_PEER_MESSAGES = 8\n",
                             "ROUND_PEER_MESSAGES = 1 << 30  # MUTANT: no bound per peer\n",
                             "tests/test_broker_fairness.py"),
    "choke-ends-unprobed": ("hurray_ipc/broker/core.py",
                            "                k.probed = True\n                self._send(rid, Pong())\n",
                            "                k.probed = True  # MUTANT: ends at the next tick, unprobed\n",
                            "tests/test_broker_core.py"),
    "choke-never-ends": ("hurray_ipc/broker/core.py",
                         "            if k.probed:\n                del self.choked[rid]\n",
                         "            if False:  # MUTANT: a probe that got through ends nothing\n"
                         "                del self.choked[rid]\n",
                         "tests/test_broker_core.py",
                         "tests/test_broker_attacks.py::test_a_peer_that_stops_reading_is_counted_and_granted_nothing_"
                         "until_it_reads_again"),
    # Credit limits (ipc-protocol.md 6a): a consumer's unused grants count, or a REQUEST and a READY
    # of 4096, over and over, make grants without bound; a bounced DELIVER's credit is the
    # consumer's own and comes back whatever the limits; every refusal names the credits it did
    # not apply, and the client asks for them again (or it waits for credits never queued).
    "grants-uncounted": ("hurray_ipc/broker/core.py",
                         "        if c.credits + c.granted + n > MAX_CREDITS:\n",
                         "        if c.credits + n > MAX_CREDITS:  # MUTANT: grants escape the limit\n",
                         "tests/test_broker_core.py"),
    "bounced-credit-limited": ("hurray_ipc/broker/core.py",
                               "                self._queue_credits(c, 1)\n                self._match(c.channel)\n",
                               "                try:  # MUTANT: through the REQUEST limits\n"
                               "                    self._add_requests(c, 1)\n"
                               "                except ProtocolError:\n                    pass\n",
                               "tests/test_broker_core.py"),
    "refused-credits-unnamed": ("hurray_ipc/broker/core.py",
                                '            if asked and e.code != "not_registered":',
                                "            if False:  # MUTANT: no credits named",
                                "tests/test_broker_core.py", "tests/test_vectors_refusals.py"),
    "named-credits-ignored": ("hurray_ipc/wire/messages.py",
                              "        return v if type(v) is int and 0 < v <= MAX_CREDITS else 0\n",
                              "        return v if type(v) is int and v > 0 and self.extra.get(\"ref\") in "
                              "(\"REQUEST\", \"READY\") else 0  # MUTANT\n",
                              "tests/test_client_refusals.py"),
    # A producer holds at most MAX_CREDITS unused grants (grants for consumers gone count for no
    # consumer), and is matched again once it holds fewer.
    "producer-grants-uncapped": ("hurray_ipc/broker/core.py",
                                 "                if c.credits > 0 and len(c.grants) < MAX_CREDITS:\n",
                                 "                if c.credits > 0:  # MUTANT: grants pile up\n",
                                 "tests/test_broker_core.py"),
    "producer-cap-never-rematched": ("hurray_ipc/broker/core.py",
                                     "                self._rechecks[g.channel] = min(self._rechecks.get(g.channel, "
                                     "math.inf), self._now)\n",
                                     "                pass  # MUTANT: its READY waits for something else\n",
                                     "tests/test_broker_core.py"),
    # Credits a limit refused are not asked again at once: the two would loop while it holds.
    "limit-refusal-asked-at-once": ("hurray_ipc/client/credits.py",
                                    '        if n and limit != "message_rate":\n            self.waiting = True\n',
                                    "        pass  # MUTANT: asked again at the next want()\n",
                                    "tests/test_client_refusals.py"),
    # A BYE past the message rate: refused, its consumer stays registered holding its buffers.
    "bye-refused-past-rate": ("hurray_ipc/broker/core.py",
                              '        if len(msgs) == 1 and msgs[0].verb == "BYE":\n',
                              '        if False:  # MUTANT: a BYE past the rate is refused whole\n',
                              "tests/test_broker_core.py"),
    # A HANDOFF that crossed its grant's REVOKE is refused unknown_grant: send() must send again.
    "revoked-not-resent": ("hurray_ipc/client/producer.py",
                           'if ticket.error is not None and ticket.error.code in ("consumer_gone", "unknown_grant"):',
                           'if ticket.error is not None and ticket.error.code in ("consumer_gone",):  # MUTANT',
                           "tests/test_clients.py"),
    # Fencing (ipc-protocol.md 5): a consumer that may still read is fenced, never "gone", and its
    # producer retires what it may read: the slot, the memory, the event.
    "fence-as-gone": ("hurray_ipc/broker/core.py",
                      '        self._release(d, "consumer_fenced")\n',
                      '        self._release(d, "consumer_gone")  # MUTANT: a fenced consumer counts as dead\n',
                      *FENCING),
    # The hold bound (ipc-protocol.md 5): a delivery held past it is fenced (its producer retires
    # the buffer), never given back as if its consumer were gone, and never left held for ever.
    "hold-fence-as-gone": ("hurray_ipc/broker/core.py",
                           "                    self.gone.add((d.token, \"event\"))\n"
                           "            self._fence_all(rid, ds)\n",
                           "                    self.gone.add((d.token, \"event\"))\n"
                           '            self._send(rid, ProducerGone([d.token for d in ds], "fenced"))\n'
                           '            for d in ds:  # MUTANT: told, but given back reusable at once\n'
                           '                self._release(d, "consumer_gone")\n',
                           "tests/test_fencing.py::test_a_consumer_holding_past_the_hold_bound_never_reads_memory_its_"
                           "producer_reused", "tests/test_broker_core.py"),
    "hold-no-bench": ("hurray_ipc/broker/core.py",
                      "            if rid in self.clients and rid not in self.benched:\n",
                      "            if False:  # MUTANT: its credits are granted again at once\n",
                      "tests/test_broker_core.py"),
    "bench-forgotten-at-bye": ("hurray_ipc/broker/core.py",
                               "            if bench is not None and now < bench[1]:",
                               "            if False:  # MUTANT: a new registration of a benched process isn't",
                               "tests/test_broker_core.py"),
    "hold-never": ("hurray_ipc/broker/core.py",
                   "        if self.hold_s is not None:\n",
                   "        if False:  # MUTANT: no hold bound\n",
                   "tests/test_broker_core.py",
                   "tests/test_fencing.py::test_a_consumer_holding_past_the_hold_bound_never_reads_memory_its_"
                   "producer_reused"),
    "fence-event-released": ("hurray_ipc/broker/core.py",
                             "        d.event_pending = False\n        self._release(d, \"consumer_fenced\")\n",
                             "        self._release(d, \"consumer_fenced\")  # MUTANT: EVENT_RELEASED too\n",
                             *FENCING),
    "fenced-slot-pooled": ("hurray_ipc/client/producer.py",
                           "            self.staging.retire(o.slot)\n",
                           "            self.staging.release(o.slot)  # MUTANT: back to the pool\n",
                           *FENCING),
    "fenced-copy-pooled": ("hurray_ipc/client/producer.py",
                           "            self.staging.retire(o.source.slot)\n",
                           "            self.staging.release(o.source.slot)  # MUTANT: back to the pool\n",
                           *FENCING),
    "fenced-event-destroyed": ("hurray_ipc/client/producer.py",
                               "        # nor destroyed before close().\n        o.event = None\n",
                               "        if o.event is not None:  # MUTANT: destroyed under the fenced consumer\n"
                               "            self.events.release(o.event)\n        o.event = None\n",
                               *FENCING),
    "fenced-memory-kept": ("hurray_ipc/client/producer.py",
                           "                buf.device.retire_memory(buf)\n",
                           "                pass  # MUTANT: the caller's pages stay under the consumer\n",
                           *FENCING),
    # The checker itself (issue 22, limit B): an exited writer's unordered write is still a race.
    "exited-writer-forgiven": ("hurray_ipc/devices/backend/hb.py",
                               "            conflict(race_kind(is_write, True), w, a, b, "
                               "forgive_gone=PRUNED in clock)\n",
                               "            conflict(race_kind(is_write, True), w, a, b, True)  # MUTANT\n",
                               "tests/test_races.py"),
    # CONSUMER_STREAM (in-process): the producer must make the consumer's declared stream wait.
    "consumer-stream-no-wait": ("hurray_ipc/client/producer.py",
                                "            inproc.stream(consumer.stream).wait(ev)  # type: ignore[arg-type]\n",
                                "            pass  # MUTANT: the consumer's stream is not ordered\n",
                                "tests/test_paths.py", "tests/test_stress.py"),
    "fenced-device-freed": ("hurray_ipc/client/producer.py",
                            "        self._fenced.append(o.source)\n",
                            "        pass  # MUTANT: mapped device memory handed back for reuse\n",
                            *FENCING),
    # Kept mappings (ipc-protocol.md 4.10): a kept allocation is freed only after every consumer it
    # was delivered to closed its mapping (UNMAP round), or left proven gone.
    "kept-freed-unasked": ("hurray_ipc/client/producer.py",
                           "        elif not k.consumers:\n",
                           "        elif True:  # MUTANT: freed without asking its consumers back\n", *KEPT),
    "kept-no-order-after-answers": ("hurray_ipc/client/producer.py",
                                    "            self.device.order_receive(order_key(me, msg.request, "
                                    "f\"unmapped:{label}\"))\n",
                                    "            pass  # MUTANT: the free is not ordered after the answers\n", *KEPT),
    "kept-fenced-freed": ("hurray_ipc/client/producer.py",
                          "        if msg.fenced:\n",
                          "        if False:  # MUTANT: freed although a fenced consumer may map it\n", *KEPT),
    "kept-not-asked-again": ("hurray_ipc/client/producer.py",
                             "        self.session.on_welcome.append(self._ask_again)\n",
                             "        pass  # MUTANT: a round lost with a restarted broker is never asked again\n",
                             *KEPT),
    "kept-answer-before-close": ("hurray_ipc/client/consumer.py",
                                 "            self.gpu.import_cache.unmap(bytes(msg.memory), answer)\n",
                                 "            answer()  # MUTANT: answered before the mapping closed\n"
                                 "            self.gpu.import_cache.unmap(bytes(msg.memory), lambda: None)\n", *KEPT),
    "kept-bye-with-mappings": ("hurray_ipc/client/consumer.py",
                               "            self.gpu.import_cache.close_idle()\n",
                               "            pass  # MUTANT: BYE with kept mappings still open\n", *KEPT),
    "kept-without-promise": ("hurray_ipc/client/consumer.py",
                             "            buf = dev.import_memory(exp, keep=msg.keep)\n",
                             "            buf = dev.import_memory(exp, keep=True)  # MUTANT: kept unasked\n", *KEPT),
    "kept-unproven-gone": ("hurray_ipc/broker/core.py",
                           "            self._unmap_left(c, proven, silent)\n",
                           "            self._unmap_left(c, True, False)  # MUTANT: silence counted as gone\n", *KEPT),
    "kept-to-an-older-broker": ("hurray_ipc/client/producer.py",
                                "                    or not self.session.kept_mappings:\n",
                                "                    or False:  # MUTANT: keep to a broker that never offered it\n",
                                *KEPT),
    "kept-to-an-older-consumer": ("hurray_ipc/broker/core.py",
                                  "            deliver.keep = False  # it would not read the flag",
                                  "            pass  # MUTANT: keep forwarded to a consumer that would not read it",
                                  *KEPT),
    "kept-bye-holding-gone": ("hurray_ipc/broker/core.py",
                              "proven = why == \"process gone\" or (why == \"bye\" and not c.held)\n",
                              "proven = why in (\"process gone\", \"bye\")  # MUTANT: a BYE while holding\n",
                              *KEPT),
    "kept-withdrawn-unmapped": ("hurray_ipc/broker/core.py",
                                "            (r.fenced if c.sent_keep else r.unmapped).append(c.label)\n",
                                "            r.unmapped.append(c.label)  # MUTANT: kept once, answered for\n", *KEPT),
    "kept-stranger-gone": ("hurray_ipc/broker/core.py",
                           "            elif label in self.gone_labels:\n",
                           "            elif True:  # MUTANT: a label never seen answered as gone\n", *KEPT),
    # A label not registered at the UNMAP is awaited (timeout_ms) and asked once it registers.
    "kept-unseen-fenced-at-once": ("hurray_ipc/broker/core.py",
                                   "        if self.unseen_of.get(r.producer, 0) >= MAX_UNSEEN:\n",
                                   "        if True:  # MUTANT: not registered yet: fenced at once\n", *KEPT),
    "kept-unseen-expires-unmapped": ("hurray_ipc/broker/core.py",
                                     "                self._unseen_done(key, r, label)\n"
                                     "                r.fenced.append(label)\n",
                                     "                self._unseen_done(key, r, label)\n"
                                     "                r.unmapped.append(label)  # MUTANT: never came, yet answered\n",
                                     *KEPT),
    "bye-after-silence-ignored": ("hurray_ipc/broker/core.py",
                                  "                self._bye_after_drop(rid)  # else nothing registered to end: "
                                  "silently done (spec §2)\n",
                                  "                pass  # MUTANT: a BYE after a silent drop proves nothing\n",
                                  "tests/test_end_of_stream.py::test_vector_on_the_core", "tests/test_broker_core.py"),
    "bye-after-drop-holding-proves": ("hurray_ipc/broker/core.py",
                                      "            silent = not proven and not c.held  # a BYE it sends later "
                                      "proves what this could not\n",
                                      "            silent = not proven  # MUTANT: dropped holding deliveries, yet its "
                                      "BYE proves it gone\n",
                                      "tests/test_end_of_stream.py::test_vector_on_the_core",
                                      "tests/test_broker_core.py", "tests/test_kept_mappings.py"),
    "fenced-allocation-freed-on-close": ("hurray_ipc/client/producer.py",
                                         "            o.kept.retired = True  # an allocation of allocate(): closing "
                                         "it frees nothing now\n",
                                         "            pass  # MUTANT: freed once its application closes it\n",
                                         "tests/test_fencing.py"),
    "closed-allocation-freed-while-out": ("hurray_ipc/client/producer.py",
                                          "        if k.free is None or k.busy:\n",
                                          "        if k.free is None:  # MUTANT: freed while a handoff is out\n",
                                          "tests/test_kept_mappings_processes.py"),
    "inproc-closed-buffer-handed": ("hurray_ipc/client/producer.py",
                                    "                inproc_obj[\"buffer\"] = Buffer(target.device, target.ptr, "
                                    "target.size)\n",
                                    "                inproc_obj[\"buffer\"] = target  # MUTANT: emptied by a close\n",
                                    "tests/test_kept_mappings_processes.py"),
    "inproc-close-not-counted": ("hurray_ipc/client/producer.py",
                                 "                    self._count_out(out, share.ptr, None, None)\n",
                                 "                    pass  # MUTANT: a close frees it while it is out in process\n",
                                 "tests/test_kept_mappings_processes.py"),
    "inproc-view-not-found": ("hurray_ipc/client/producer.py",
                              "                    k = self._kept.get(self.gpu.base_of(ptr))  "
                              "# type: ignore[union-attr]\n",
                              "                    k = None  # MUTANT: a view inside an allocation is not counted\n",
                              "tests/test_kept_mappings_processes.py"),
    # A buffer closed by another thread while its send waited for a grant (or between a re-send's
    # tries): sent anyway, by a cached export of unlinked memory or an export of address 0.
    "closed-buffer-sent-after-grant": ("hurray_ipc/client/producer.py",
                                       "        if buf.closed:  # by another thread while send() ran (a re-send): "
                                       "no memory to hand off\n",
                                       "        if False:  # MUTANT: a buffer closed meanwhile is sent\n",
                                       *GIVE_BACK),
    # A failed send of an allocation closed meanwhile queues its next step; close() must run it.
    "close-drain-skipped": ("hurray_ipc/client/producer.py",
                            "                for k in [k for k in self._kept.values() if not k.retired]:  "
                            "# retired: warned at its close\n                    self._dispose(k)\n",
                            "                pass  # MUTANT: a queued step of a closed allocation never runs\n",
                            "tests/test_kept_mappings_processes.py"),
    "free-taken-twice": ("hurray_ipc/client/producer.py",
                         "            free, k.free = k.free, None\n",
                         "            free = k.free  # MUTANT: the free is not taken as it runs\n",
                         "tests/test_kept_mappings_processes.py"),
    # A release proves the producer's own writes complete only when its consumer waited on them
    # (sync-contract §3): the buffer goes back once the handoff's event completed.
    "own-writes-not-awaited": ("hurray_ipc/client/producer.py",
                               "        if free_source and outcome != \"consumer_fenced\" and o.event is not None "
                               "and not self._writes_done(o):\n",
                               "        if False:  # MUTANT: handed back at the release, our writes maybe running\n",
                               "tests/test_paths.py"),
    "settled-never": ("hurray_ipc/client/producer.py",
                      "            self.session.deferred += self._finish(hid, outcome, free_source)\n",
                      "            self._settling[hid] = (outcome, free_source)  # MUTANT: never given back\n",
                      "tests/test_paths.py"),
    "close-settle-skipped": ("hurray_ipc/client/producer.py",
                             "            if self._settling:\n                self._settle_now()\n",
                             "            pass  # MUTANT: nothing given back after the last pump round\n",
                             "tests/test_paths.py"),
    # The pump runs what its owner's poll queued in the same round, before the call it serves returns.
    "poll-callbacks-late": ("hurray_ipc/client/session.py",
                            "        busy = self._poll() if self._poll is not None else False  # it may queue "
                            "callbacks: taken just below\n        if self.deferred:\n            "
                            "out.extend(self.deferred)\n            self.deferred.clear()\n",
                            "        if self.deferred:  # MUTANT: what the poll queues waits for the next round\n"
                            "            out.extend(self.deferred)\n            self.deferred.clear()\n"
                            "        busy = self._poll() if self._poll is not None else False\n",
                            "tests/test_paths.py"),
    "pooled-event-before-complete": ("hurray_ipc/client/producer.py",
                                     "pool.pooled and self._writes_done(o):\n",
                                     "pool.pooled:  # MUTANT: re-pooled before it completed\n",
                                     "tests/test_paths.py"),
    "consumer-stream-event-dropped": ("hurray_ipc/client/producer.py",
                                      "            # Kept until the release all the same: it tells _finish when our "
                                      "writes completed.\n",
                                      "            out.event = None  # MUTANT: given up once the wait is enqueued\n"
                                      "            self.events.release(ev)  # type: ignore[union-attr]\n",
                                      "tests/test_paths.py"),
    "left-unproven-forgets-keep": ("hurray_ipc/broker/core.py",
                                   "                _remember(self.left_unproven, rid, c.sent_keep, "
                                   "_GONE_LABELS)\n",
                                   "                _remember(self.left_unproven, rid, False, _GONE_LABELS)\n",
                                   "tests/test_kept_mappings.py"),
    "drop-past-bound-restarts": ("hurray_ipc/broker/core.py",
                                 "            if self._await_unseen(key, r, c.label):  # the latest deadline of all: "
                                 "moved to the end\n",
                                 "            if self._await_unseen(key, r, c.label) or r.unseen:  # MUTANT\n",
                                 "tests/test_kept_mappings.py"),
    "kept-silent-drop-fenced": ("hurray_ipc/broker/core.py",
                                "            if not silent:\n",
                                "            if True:  # MUTANT: a silent drop fences its rounds\n",
                                "tests/test_end_of_stream.py::test_vector_on_the_core", "tests/test_kept_mappings.py"),
    "kept-silent-drop-old-deadline": ("hurray_ipc/broker/core.py",
                                      "                r.until = self._now + self.timeout_s\n",
                                      "                pass  # MUTANT: time runs from the UNMAP\n",
                                      "tests/test_kept_mappings.py", "tests/test_broker_core.py"),
    "kept-silent-drop-out-of-order": ("hurray_ipc/broker/core.py",
                                      "                self.unseen_rounds.pop(key, None)\n",
                                      "                pass  # MUTANT: restarted, keeps its place\n",
                                      "tests/test_kept_mappings.py"),
    "kept-unseen-never-asked": ("hurray_ipc/broker/core.py",
                                "        if role == \"consumer\":\n            self._registered(c)\n",
                                "        if False:  # MUTANT: a late registration is not asked\n"
                                "            self._registered(c)\n", *KEPT),
    "kept-unmap-header-64k": ("hurray_ipc/wire/ipc.py",
                              "             else MAX_UNMAP_BYTES if verb in (\"UNMAP\", \"UNMAPPED\") "
                              "else MAX_HEADER_BYTES)",
                              "             else MAX_HEADER_BYTES)  # MUTANT: 4096 labels do not fit", *KEPT),
    # Threads waiting in one client (issue 24): none sleeps holding the session lock, and whoever
    # dispatches, or consumes the socket's edge, or closes, wakes the sleeping ones.
    "wait-holding-the-lock": ("hurray_ipc/client/session.py",
                              "                        lead = not self._leader\n",
                              "                        self._sleep.poll(int(wait * 1000))  # MUTANT: under the lock\n"
                              "                        lead = False\n", *THREADS),
    "followers-not-woken": ("hurray_ipc/client/session.py",
                            "        if self._followers:\n            with self._turn:",
                            "        if False:  # MUTANT: followers sleep on\n            with self._turn:", *THREADS),
    "leader-not-poked-after-a-dispatch": ("hurray_ipc/client/session.py",
                                          "        if self._leader:\n            self._poke()\n",
                                          "        pass  # MUTANT: the leader sleeps on\n", *THREADS),
    "leader-not-poked-after-a-send": ("hurray_ipc/client/session.py",
                                      "                self._poke()  # the send took",
                                      "                pass  # MUTANT: the send took", *THREADS),
    "leader-not-woken-at-close": ("hurray_ipc/client/session.py",
                                  "            self._wake_others()  # before the socket goes: a leader polls its fd\n",
                                  "            pass  # MUTANT: no wake at close\n", *THREADS),
    # release_many is all or nothing: another thread's release of one of its handoffs lands
    # before or after the whole list, never between its check and its releases.
    "release-outside-the-session-lock": ("hurray_ipc/client/consumer.py",
                                         "        with self._consumer.session.lock:\n            if self.released:",
                                         "        if True:  # MUTANT\n            if self.released:", *THREADS),
    # The race checker's notes (issue 24): a writer checks under the slot's lock that the free
    # slot it chose is still free, or it overwrites another message's note (an edge lost).
    # An exporter's destroy reads the importers' waits and moves the slot's generation on in one
    # locked section, so a wait issued meanwhile is either checked or refused.
    "destroy-waits-read-apart": ("hurray_ipc/devices/backend/emulated.py",
                                 "                    waits, host = ev._state()[1], dict(self._host_clock)\n",
                                 "                    waits, host = ev._state()[1], dict(self._host_clock)\n"
                                 "            with ev.lock:  # MUTANT: the generation moves on in a second section\n",
                                 "tests/test_emulated_events.py"),
    "destroy-host-read-late": ("hurray_ipc/devices/backend/emulated.py",
                               "                    waits, host = ev._state()[1], dict(self._host_clock)\n",
                               "                    waits, host = ev._state()[1], self._host_clock  # MUTANT: late\n",
                               "tests/test_emulated_events.py"),
    # An event slot's byte lock is the descriptor's (OFD), so two runtimes of one process (the
    # tests' stand-in for two processes) exclude each other; a process-owned lock lets both in.
    "slot-lock-process-owned": ("hurray_ipc/devices/shm.py",
                                "fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if lock else fcntl.F_OFD_SETLK,",
                                "fcntl.fcntl(fd, fcntl.F_SETLKW if lock else fcntl.F_SETLK,  # MUTANT",
                                "tests/test_emulated_events.py"),
    # An attached table closes with every slot's thread lock held, so a late record never locks a
    # closed (or reused) descriptor.
    "table-close-unlocked": ("hurray_ipc/devices/backend/emulated.py",
                             "        for lock in self.locks:\n            lock.local.acquire()\n        try:\n"
                             "            self.seg.close()\n        finally:\n            for lock in self.locks:\n"
                             "                lock.local.release()\n",
                             "        self.seg.close()  # MUTANT: closed under a late record\n",
                             "tests/test_emulated_events.py"),
    "mailbox-claim-unchecked": ("hurray_ipc/devices/backend/mailbox.py",
                                "        if struct.unpack_from(\"<Q\", self.map, slot * 8)[0] == expect:\n",
                                "        if True:  # MUTANT: taken meanwhile or not\n", "tests/test_mailbox.py"),
    # Consumer.close() with a handoff the application still holds: BYE at once, so the broker hands
    # the buffer back (spec §5) while the consumer's read of it may still run.
    "close-bye-while-held": ("hurray_ipc/client/consumer.py",
                             "        return [ho for ho in self._held.values() if not ho.released and not "
                             "ho.producer_gone]\n",
                             "        return [ho for ho in self._waiting.values() if not ho.released]  "
                             "# MUTANT: only the untaken\n",
                             "tests/test_paths.py", "tests/test_clients.py"),
    # ... with a release still owed (device work past the timeout, a silent broker, a failed release).
    "close-bye-while-releases-owed": ("hurray_ipc/client/consumer.py",
                                      "            return not owed and not failed\n",
                                      "            return True  # MUTANT: BYE while a release is owed\n",
                                      "tests/test_paths.py"),
    # ... with a handoff the garbage collector queued un-released (not in _held any more).
    "close-bye-before-collected-released": ("hurray_ipc/client/consumer.py",
                                            "                self._poll_releases()  # un-released handoffs the garbage "
                                            "collector found: released first\n",
                                            "                pass  # MUTANT: collected handoffs left to the broker\n",
                                            "tests/test_paths.py"),
    # ... with a delivery that arrived while close() waited for the others' device work.
    "close-single-round": ("hurray_ipc/client/consumer.py",
                           "        for _ in range(3):  # a delivery that arrives while close() waits is released in "
                           "the next round\n",
                           "        for _ in range(1):  # MUTANT: what arrives meanwhile is left to the BYE\n",
                           "tests/test_paths.py"),
    # receive() in another thread while close() waits: takes, or waits for, what close() will not release.
    "receive-while-closing": ("hurray_ipc/client/consumer.py",
                              "                                stop=lambda: self.core.ended or self._closing, "
                              "take_next=self._take)\n",
                              "                                stop=lambda: self.core.ended, take_next=self._take)  "
                              "# MUTANT\n",
                              "tests/test_paths.py"),
    # A stream ordered (__dlpack__(stream=) / order_onto) after the handoff was released: its reads
    # would run on memory the producer may be writing.
    "order-onto-after-release": ("hurray_ipc/client/consumer.py",
                                 "        :meth:`wait`, refused once the handoff was released or its producer is gone."
                                 "\"\"\"\n        self._check_usable()\n",
                                 "        :meth:`wait`, refused once the handoff was released or its producer is gone."
                                 "\"\"\"\n        pass  # MUTANT: ordered after the release\n",
                                 "tests/test_paths.py"),
}


def make_copy(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split()
    for f in files:
        src = ROOT / f
        if src.is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f)


def check_copy_is_imported(tree: Path) -> None:
    """Every module a mutant may edit must import from ``tree`` under the suite's environment."""
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    mods = sorted({m for m, *_ in MUTANTS.values()})
    code = ("import importlib, sys\n"
            f"for path in {mods!r}:\n"
            "    name = path.removesuffix('.py').replace('/', '.')\n"
            "    print(importlib.import_module(name).__file__)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, check=True, capture_output=True,
                         text=True).stdout.split()
    stray = [f for f in out if not Path(f).resolve().is_relative_to(tree.resolve())]
    if stray:
        raise SystemExit(f"the mutated copy is not the code under test: {stray} import from outside {tree}")


def apply(dest: Path, name: str) -> None:
    path, old, new = MUTANTS[name][:3]
    text = (dest / path).read_text()
    if text.count(old) != 1:
        raise SystemExit(f"mutant {name}: the step to sabotage occurs {text.count(old)} times in {path} "
                         "(expected exactly once): update MUTANTS in scripts/sync_mutants.py")
    (dest / path).write_text(text.replace(old, new))


def _pytest(tree: Path, tests: list[str], *args: str) -> tuple[int, int, str, list[str]]:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *args, *tests],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=1200)
    lines = proc.stdout.strip().splitlines()
    tail = lines[-1] if lines else proc.stderr[-500:]
    failed = sum(int(n) for n in re.findall(r"(\d+) (?:failed|error)", tail))
    passed = sum(int(n) for n in re.findall(r"(\d+) passed", tail))
    # A test can both fail and error (in its race-check teardown): count each test once.
    which = list(dict.fromkeys(ln.split(" - ")[0].removeprefix("FAILED ").removeprefix("ERROR ") for ln in lines
                               if ln.startswith(("FAILED ", "ERROR "))))
    return (len(which) if which else failed), passed, tail, which


def run_suite(tree: Path, tests: list[str]) -> tuple[int, int, str, list[str]]:
    """The tests as scripts/test runs them: on pytest-xdist workers (they inherit PYTHONPATH, so
    they import the copy), then those marked machine_wide alone, which a test beside them could
    decide (pytest exits 5 there when the files hold none: nothing counted)."""
    f1, p1, t1, w1 = _pytest(tree, tests, "-n", str(pytest_workers.count()), "-m", "not machine_wide")
    f2, p2, t2, w2 = _pytest(tree, tests, "-m", "machine_wide")
    return f1 + f2, p1 + p2, f"{t1} | machine_wide: {t2}", w1 + w2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mutants", nargs="*", metavar="MUTANT", help=f"which to run (default: all of {', '.join(MUTANTS)})")
    ap.add_argument("--tests", nargs="+", default=TESTS, help="test files to run against each mutant")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    ap.add_argument("-v", "--verbose", action="store_true", help="list the tests that caught each mutant")
    a = ap.parse_args(argv)
    unknown = [m for m in a.mutants if m not in MUTANTS]
    if unknown:
        ap.error(f"unknown mutant(s) {', '.join(unknown)}; expected {', '.join(MUTANTS)}")
    names = a.mutants or list(MUTANTS)
    holes = 0
    runs = ([] if a.no_baseline else [None]) + names
    for name in runs:
        with tempfile.TemporaryDirectory(prefix="hurray-mutant-") as tmp:
            tree = Path(tmp)
            make_copy(tree)
            check_copy_is_imported(tree)
            if name is not None:
                apply(tree, name)
            tests = list(MUTANTS[name][3:]) if name is not None and len(MUTANTS[name]) > 3 else a.tests
            if name is None:  # the baseline runs every file some mutant is checked against
                tests = list(dict.fromkeys([*a.tests, *(t for m in names for t in MUTANTS[m][3:])]))
            t0 = time.monotonic()
            failed, passed, tail, which = run_suite(tree, tests)
            secs = time.monotonic() - t0
        label = name or "baseline (no mutant)"
        if name is None:
            verdict = "ok" if failed == 0 else "THE UNMUTATED SUITE FAILS"
            holes += failed > 0
        else:
            verdict = f"caught by {failed} test(s)" if failed else "NOT CAUGHT"
            holes += failed == 0
        print(f"{label:<24} {verdict:<28} ({passed} passed, {secs:.0f} s)  [{tail}]", flush=True)
        for test in which if a.verbose or name is None else []:
            print(f"    {test}", flush=True)
    return 1 if holes else 0


if __name__ == "__main__":
    sys.exit(main())
