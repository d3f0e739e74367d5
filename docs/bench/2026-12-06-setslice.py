#!/usr/bin/env python3
# 2026-12-06-setslice.py PID SLICE_US [NAME_PREFIX]: sched_setattr(SCHED_OTHER, sched_runtime =
# slice) on those threads of PID whose name starts with NAME_PREFIX (x86_64 system call numbers).
import ctypes, os, sys, struct
pid=int(sys.argv[1]); slice_ns=int(float(sys.argv[2])*1000); prefix=sys.argv[3] if len(sys.argv)>3 else ""
libc=ctypes.CDLL(None, use_errno=True)
SYS_sched_setattr=314; SYS_sched_getattr=315
for tid in sorted(os.listdir(f"/proc/{pid}/task")):
    name=open(f"/proc/{pid}/task/{tid}/comm").read().strip()
    if not name.startswith(prefix): continue
    # struct sched_attr: u32 size, u32 policy, u64 flags, s32 nice, u32 prio, u64 runtime, u64 deadline, u64 period, u32 util_min, u32 util_max
    attr=struct.pack("IIQiIQQQII",56,0,0,0,0,slice_ns,0,0,0,0)
    buf=ctypes.create_string_buffer(attr,56)
    r=libc.syscall(SYS_sched_setattr,int(tid),buf,0)
    out=ctypes.create_string_buffer(56)
    libc.syscall(SYS_sched_getattr,int(tid),out,56,0)
    got=struct.unpack("IIQiIQQQII",out.raw)
    print(f"tid {tid} {name}: set rc={r} errno={ctypes.get_errno()} runtime now {got[5]} ns")
