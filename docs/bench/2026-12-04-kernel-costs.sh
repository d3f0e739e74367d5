#!/bin/bash
# 2026-12-04: what the kernel charges a proxy for each call on this machine, to bound what
# another I/O model (io_uring) could save: a bare system call (getppid), a loopback TCP send
# of a 120-byte message (about a pgbench statement's Bind/Execute/Sync) plus the recv of it
# in the same process (no one to wake), and a ping-pong between two processes over loopback
# TCP (per round trip two sends, two recvs and two wake-ups; CPU = both processes' user +
# system time). Each figure is printed for three runs, then for three with both processes
# pinned to one CPU.
# Usage: bash docs/bench/2026-12-04-kernel-costs.sh [ITERATIONS]   (needs a C compiler)
set -euo pipefail
n=${1:-200000}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat >"$work/kc.c" <<'C'
/* The three measurements above, in C so that nothing but the calls is timed. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}
static double cpu_us(int who) {
    struct rusage r;
    getrusage(who, &r);
    return r.ru_utime.tv_sec * 1e6 + r.ru_utime.tv_usec + r.ru_stime.tv_sec * 1e6 + r.ru_stime.tv_usec;
}
static void tcp_pair(int fds[2]) {
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t n = sizeof a;
    if (bind(l, (void *)&a, n) || listen(l, 1) || getsockname(l, (void *)&a, &n)) exit(1);
    fds[0] = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(fds[0], (void *)&a, n)) exit(1);
    fds[1] = accept(l, 0, 0);
    close(l);
    setsockopt(fds[0], IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    setsockopt(fds[1], IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}
int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 200000;
    char buf[4096] = {0};
    const int msg = 120; /* about a pgbench statement's Bind/Execute/Sync */

    double t0 = now_us();
    for (int i = 0; i < n; i++) syscall(SYS_getppid);
    printf("bare system call (getppid): %.2f us\n", (now_us() - t0) / n);

    int p[2];
    tcp_pair(p);
    t0 = now_us();
    for (int i = 0; i < n; i++) {
        if (send(p[0], buf, msg, 0) != msg) exit(1);
        if (recv(p[1], buf, sizeof buf, 0) != msg) exit(1);
    }
    printf("loopback TCP send + recv of %d bytes, no wake-up: %.2f us per pair\n", msg,
           (now_us() - t0) / n);

    /* Ping-pong: the child echoes; the parent's wall time per round trip covers two sends,
     * two recvs and two wake-ups; CPU is the two processes' user + system time. */
    int q[2];
    tcp_pair(q);
    fflush(stdout);
    pid_t c = fork();
    if (c == 0) {
        for (int i = 0; i < n; i++) {
            if (recv(q[1], buf, sizeof buf, 0) != msg) exit(1);
            if (send(q[1], buf, msg, 0) != msg) exit(1);
        }
        exit(0);
    }
    double c0 = cpu_us(RUSAGE_SELF);
    t0 = now_us();
    for (int i = 0; i < n; i++) {
        if (send(q[0], buf, msg, 0) != msg) exit(1);
        if (recv(q[0], buf, sizeof buf, 0) != msg) exit(1);
    }
    double wall = now_us() - t0, mine = cpu_us(RUSAGE_SELF) - c0;
    waitpid(c, 0, 0);
    double theirs = cpu_us(RUSAGE_CHILDREN);
    printf("ping-pong between two processes: %.2f us per round trip, CPU %.2f us (both sides)\n",
           wall / n, (mine + theirs) / n);
    return 0;
}
C
cc -O2 -o "$work/kc" "$work/kc.c"
for _ in 1 2 3; do "$work/kc" "$n"; done
# The same with both processes on one CPU: the wake-up needs no other CPU.
echo "pinned to CPU 0 (taskset -c 0):"
for _ in 1 2 3; do taskset -c 0 "$work/kc" "$n"; done
