"""The real CUDA runtime, through cuda.bindings.runtime (the cuda-bindings package: extras cuda12/cuda13).

Every cuda.bindings call returns ``(err, value...)``; :func:`_check` turns a non-success ``err``
into a :class:`DeviceError` that names the call and the CUDA error. Nothing here caches device
state beyond what the driver itself keeps (the current device is asked of the runtime every time:
other libraries in the process call cudaSetDevice too), except the IPC probe results, which are
properties of the device. Without cuda-bindings, or with bindings the driver cannot run, the
runtime still constructs and :meth:`RealRuntime.probe` says why, with the fix (:mod:`.driver`).
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
from typing import Any

from ..errors import DeviceError
from . import driver as _driver
from .base import IPC_HANDLE_SIZE, Runtime, check_blob

log = logging.getLogger("hurray.cuda")


def _import_bindings():
    try:
        from cuda.bindings import driver, runtime
    except ImportError:  # cuda-python < 12.6 spells it cuda.cudart
        from cuda import cuda as driver
        from cuda import cudart as runtime
    return runtime, driver


def explain(failure: str) -> str:
    """``failure`` led by what the driver and installed cuda-bindings say about it, when they do not
    fit (no driver, bindings for a newer CUDA than the driver's, none installed): the fix first."""
    why = _driver.diagnose(_driver.driver_cuda_version(), _driver.bindings_version())
    return failure if why is None else f"{why} ({failure})"


def _err_name(err: Any) -> str:
    return getattr(err, "name", None) or str(err)


def _check(call: str, result: Any) -> Any:
    """Unpack a cuda.bindings result tuple, raising on error."""
    if not isinstance(result, tuple):
        result = (result,)
    err = result[0]
    if int(err) != 0:
        raise DeviceError(call, "CUDA call failed", code=_err_name(err))
    rest = result[1:]
    return rest[0] if len(rest) == 1 else (rest or None)


def _handle_bytes(h: Any) -> bytes:
    reserved = getattr(h, "reserved", None)
    if reserved is not None:
        return bytes(bytearray(reserved))[:IPC_HANDLE_SIZE]
    return ctypes.string_at(h.getPtr(), IPC_HANDLE_SIZE)


def _handle_from(cls: Any, blob: bytes) -> Any:
    h = cls()
    ctypes.memmove(h.getPtr(), blob, IPC_HANDLE_SIZE)
    return h


class RealRuntime(Runtime):
    name = "real"
    emulated = False

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ipc: dict[int, dict[str, str | None]] = {}  # ordinal -> capability -> why not (None: works)
        # Without cuda-bindings (CPU-only installs have none) the runtime still exists and probe()
        # says why it cannot work, so callers report it instead of failing on an ImportError.
        self._unusable: str | None = None
        try:
            self.rt, self.drv = _import_bindings()
        except ImportError as e:
            self.rt = self.drv = None
            self._unusable = explain(f"cuda.bindings does not import: {e}")

    def _ok(self, call: str, result: Any) -> Any:
        """:func:`_check`, and after a failed call cudaGetLastError, so that no error of ours stays
        in the runtime's per-thread last-error state, where the application's next launch check
        (PyTorch's) would find it and fail (pytorch#18584, #61554). The DeviceError carries it."""
        try:
            return _check(call, result)
        except DeviceError:
            clear = getattr(self.rt, "cudaGetLastError", None)
            if clear is not None:
                clear()
            raise

    def probe(self) -> str | None:
        if self._unusable is not None:
            return self._unusable
        try:
            n = self._ok("cudaGetDeviceCount", self.rt.cudaGetDeviceCount())
        except RuntimeError as e:  # DeviceError; cuda-bindings 12 raises "Failed to dlopen libcuda.so.1"
            return explain(str(e))
        return None if n > 0 else explain("cudaGetDeviceCount: no CUDA device present")

    def device_count(self) -> int:
        return int(self._ok("cudaGetDeviceCount", self.rt.cudaGetDeviceCount()))

    def set_device(self, ordinal: int) -> None:
        # No per-thread cache: PyTorch/CuPy may have changed the current device since our last call.
        if self.get_device() != ordinal:
            self._ok("cudaSetDevice", self.rt.cudaSetDevice(ordinal))

    def get_device(self) -> int:
        return int(self._ok("cudaGetDevice", self.rt.cudaGetDevice()))

    def device_uuid(self, ordinal: int) -> str:
        props = self._ok("cudaGetDeviceProperties", self.rt.cudaGetDeviceProperties(ordinal))
        raw = bytes(bytearray(props.uuid.bytes))[:16]
        h = raw.hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"

    def pci_bus_id(self, ordinal: int) -> str:
        raw = self._ok("cudaDeviceGetPCIBusId", self.rt.cudaDeviceGetPCIBusId(32, ordinal))
        return bytes(raw).split(b"\0", 1)[0].decode("ascii", "replace")

    def _attr(self, attr: str, ordinal: int) -> int:
        return int(self._ok(f"cudaDeviceGetAttribute({attr})",
                          self.rt.cudaDeviceGetAttribute(getattr(self.rt.cudaDeviceAttr, attr), ordinal)))

    def ipc_memory_support(self, ordinal: int) -> bool:
        return self._ipc_probe(ordinal)["ipc_memory"] is None

    def ipc_event_support(self, ordinal: int) -> bool:
        return self._ipc_probe(ordinal)["ipc_events"] is None

    def unsupported_reason(self, ordinal: int, capability: str) -> str | None:
        return self._ipc_probe(ordinal).get(capability)

    def rdma_write_ordering(self, ordinal: int) -> str | None:
        owner = int(self.rt.cudaGPUDirectRDMAWritesOrdering.cudaGPUDirectRDMAWritesOrderingOwner)
        host = int(self.rt.cudaFlushGPUDirectRDMAWritesOptions.cudaFlushGPUDirectRDMAWritesOptionHost)
        if self._attr("cudaDevAttrGPUDirectRDMAWritesOrdering", ordinal) >= owner:
            return None
        if self._attr("cudaDevAttrGPUDirectRDMAFlushWritesOptions", ordinal) & host:
            return None
        return ("the device neither orders GPUDirect RDMA writes (cudaDevAttrGPUDirectRDMAWritesOrdering) nor "
                "supports cudaDeviceFlushGPUDirectRDMAWrites (cudaDevAttrGPUDirectRDMAFlushWritesOptions)")

    def flush_rdma_writes(self) -> None:
        ordinal = int(self._ok("cudaGetDevice", self.rt.cudaGetDevice()))
        owner = self.rt.cudaGPUDirectRDMAWritesOrdering.cudaGPUDirectRDMAWritesOrderingOwner
        if self._attr("cudaDevAttrGPUDirectRDMAWritesOrdering", ordinal) >= int(owner):
            return  # ordered by the device for its own context: the flush would be a no-op
        self._ok("cudaDeviceFlushGPUDirectRDMAWrites", self.rt.cudaDeviceFlushGPUDirectRDMAWrites(
            self.rt.cudaFlushGPUDirectRDMAWritesTarget.cudaFlushGPUDirectRDMAWritesTargetCurrentDevice,
            self.rt.cudaFlushGPUDirectRDMAWritesScope.cudaFlushGPUDirectRDMAWritesToOwner))

    def host_register_support(self, ordinal: int) -> bool:
        return self._attr("cudaDevAttrHostRegisterSupported", ordinal) == 1

    def _ipc_probe(self, ordinal: int) -> dict[str, str | None]:
        """Why IPC memory / IPC events do not work on ``ordinal`` (None: they do), probed once:
        an answer is kept for the life of the process unless a call failed on the way (a transient
        failure, e.g. no memory left for the probe's allocation), which is asked again next time.

        Attributes alone are not enough (WSL2 reports unified addressing but has no CUDA IPC), so
        each probe also does the real thing once: export a small allocation's cudaIpcMemHandle, and
        create an interprocess event and get its cudaIpcEventHandle. The caller's device is current
        again afterwards.
        """
        with self._lock:
            hit = self._ipc.get(ordinal)
        if hit is not None:
            return hit
        why: dict[str, str | None] = {"ipc_memory": None, "ipc_events": None}
        transient = False  # a call that failed (out of memory, a busy device): ask again next time
        if not sys.platform.startswith("linux"):
            why = dict.fromkeys(why, f"CUDA IPC is Linux-only (this is {sys.platform})")
        else:
            prev = self.get_device()
            try:
                self.set_device(ordinal)
                if self._attr("cudaDevAttrUnifiedAddressing", ordinal) != 1:
                    why["ipc_memory"] = "cudaDevAttrUnifiedAddressing is 0"
                else:
                    why["ipc_memory"] = self._try_export_memory()
            except DeviceError as e:
                why["ipc_memory"], transient = str(e), True
            try:
                self.set_device(ordinal)
                if self._attr("cudaDevAttrIpcEventSupport", ordinal) != 1:
                    why["ipc_events"] = "cudaDevAttrIpcEventSupport is 0"
                else:
                    why["ipc_events"] = self._try_export_event()
            except DeviceError as e:
                why["ipc_events"], transient = str(e), True
            finally:
                self.set_device(prev)
        for what, reason in why.items():
            if reason is not None:
                log.warning("cuda:%d: %s unsupported: %s", ordinal, what, reason)
        if not transient:
            with self._lock:
                self._ipc[ordinal] = why
        return why

    def _try_export_memory(self) -> str | None:
        ptr = int(self._ok("cudaMalloc", self.rt.cudaMalloc(256)))
        try:
            self._ok("cudaIpcGetMemHandle", self.rt.cudaIpcGetMemHandle(ptr))
        except DeviceError as e:
            return str(e)
        finally:
            self._ok("cudaFree", self.rt.cudaFree(ptr))
        return None

    def _try_export_event(self) -> str | None:
        flags = self.rt.cudaEventDisableTiming | self.rt.cudaEventInterprocess
        ev = self._ok("cudaEventCreateWithFlags", self.rt.cudaEventCreateWithFlags(flags))
        try:
            self._ok("cudaIpcGetEventHandle", self.rt.cudaIpcGetEventHandle(ev))
        except DeviceError as e:
            return str(e)
        finally:
            self._ok("cudaEventDestroy", self.rt.cudaEventDestroy(ev))
        return None

    def can_access_peer(self, ordinal: int, peer: int) -> bool:
        if ordinal == peer:
            return True
        return bool(self._ok("cudaDeviceCanAccessPeer", self.rt.cudaDeviceCanAccessPeer(ordinal, peer)))

    def malloc(self, nbytes: int) -> int:
        return int(self._ok("cudaMalloc", self.rt.cudaMalloc(max(nbytes, 1))))

    def free(self, ptr: int) -> None:
        self._ok("cudaFree", self.rt.cudaFree(ptr))

    def mem_range(self, ptr: int) -> tuple[int, int]:
        base, size = self._ok("cuMemGetAddressRange", self.drv.cuMemGetAddressRange(self.drv.CUdeviceptr(ptr)))
        return int(base), int(size)

    def ipc_get_mem_handle(self, base: int) -> bytes:
        return _handle_bytes(self._ok("cudaIpcGetMemHandle", self.rt.cudaIpcGetMemHandle(base)))

    def ipc_open_mem_handle(self, blob: bytes) -> int:
        raw = check_blob(blob, "cudaIpcOpenMemHandle", emulated=False)
        h = _handle_from(self.rt.cudaIpcMemHandle_t, raw)
        return int(self._ok("cudaIpcOpenMemHandle",
                          self.rt.cudaIpcOpenMemHandle(h, self.rt.cudaIpcMemLazyEnablePeerAccess)))

    def ipc_close_mem_handle(self, base: int) -> None:
        self._ok("cudaIpcCloseMemHandle", self.rt.cudaIpcCloseMemHandle(base))

    def host_register(self, ptr: int, nbytes: int) -> None:
        self._ok("cudaHostRegister", self.rt.cudaHostRegister(ptr, nbytes, self.rt.cudaHostRegisterPortable))

    def host_unregister(self, ptr: int) -> None:
        self._ok("cudaHostUnregister", self.rt.cudaHostUnregister(ptr))

    def stream_create(self) -> Any:
        return self._ok("cudaStreamCreateWithFlags", self.rt.cudaStreamCreateWithFlags(self.rt.cudaStreamNonBlocking))

    def stream_destroy(self, stream: Any) -> None:
        self._ok("cudaStreamDestroy", self.rt.cudaStreamDestroy(stream))

    def stream_synchronize(self, stream: Any) -> None:
        self._ok("cudaStreamSynchronize", self.rt.cudaStreamSynchronize(stream))

    def _done(self, call: str, result: Any) -> bool:
        """A query's answer: cudaErrorNotReady means 'not yet' (and is cleared from the per-thread
        last error, which the query set: pytorch#18584), any other error raises."""
        if result[0] == self.rt.cudaError_t.cudaErrorNotReady:
            self.rt.cudaGetLastError()  # this runtime's own (not the module's: tests inject fakes)
            return False
        self._ok(call, result)
        return True

    def stream_query(self, stream: Any) -> bool:
        return self._done("cudaStreamQuery", self.rt.cudaStreamQuery(stream))

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        self._ok("cudaStreamWaitEvent", self.rt.cudaStreamWaitEvent(stream, event, 0))

    def stream_id(self, stream: Any) -> int:
        return int(stream)

    def stream_from_id(self, ident: int) -> Any:
        return self.rt.cudaStream_t(ident)

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self._ok("cudaMemcpyAsync",
               self.rt.cudaMemcpyAsync(dst, src, nbytes, self.rt.cudaMemcpyKind.cudaMemcpyDefault, stream))

    def memset_async(self, ptr: int, value: int, nbytes: int, stream: Any) -> None:
        self._ok("cudaMemsetAsync", self.rt.cudaMemsetAsync(ptr, value, nbytes, stream))

    def event_create(self, interprocess: bool) -> Any:
        flags = self.rt.cudaEventDisableTiming | (self.rt.cudaEventInterprocess if interprocess else 0)
        return self._ok("cudaEventCreateWithFlags", self.rt.cudaEventCreateWithFlags(flags))

    def event_destroy(self, event: Any) -> None:
        self._ok("cudaEventDestroy", self.rt.cudaEventDestroy(event))

    def event_record(self, event: Any, stream: Any) -> None:
        self._ok("cudaEventRecord", self.rt.cudaEventRecord(event, stream))

    def event_synchronize(self, event: Any) -> None:
        self._ok("cudaEventSynchronize", self.rt.cudaEventSynchronize(event))

    def event_query(self, event: Any) -> bool:
        return self._done("cudaEventQuery", self.rt.cudaEventQuery(event))

    def ipc_get_event_handle(self, event: Any) -> bytes:
        return _handle_bytes(self._ok("cudaIpcGetEventHandle", self.rt.cudaIpcGetEventHandle(event)))

    def ipc_open_event_handle(self, blob: bytes) -> Any:
        raw = check_blob(blob, "cudaIpcOpenEventHandle", emulated=False)
        h = _handle_from(self.rt.cudaIpcEventHandle_t, raw)
        return self._ok("cudaIpcOpenEventHandle", self.rt.cudaIpcOpenEventHandle(h))
