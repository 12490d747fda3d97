/* A model of a two-thread team beside a busy core, for bench/team_scheduling.py.
 *
 *     team_scheduling MODE UNITS SECONDS REPS
 *
 * One call is REPS rounds of arithmetic on an L1-resident buffer, cut into UNITS equal units, run:
 *   one     on the calling thread alone;
 *   static  on an OpenMP team of two that splits the units statically, as oneDNN's primitives
 *           and the runtime's own team kernels do: the call waits for both members;
 *   helper  by the calling thread and one helper thread that take units from a shared counter:
 *           a unit the helper has not taken by the time the caller runs out is the caller's, so
 *           the call waits only for units the helper took, never for a helper that is not running.
 * It prints one JSON line: the calls' median, mean and 99th percentile in seconds, and their count.
 */
#define _GNU_SOURCE
#include <immintrin.h>
#include <linux/futex.h>
#include <omp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define WIDTH 2048
#define MAX_CALLS 4000000

static float data[WIDTH];
static volatile float sink;
static long reps_per_unit;
static int units;
static long helper_spins; /* pause rounds the idle helper spins before it sleeps: GOMP_SPINCOUNT, as libgomp's workers */

static void run_unit(void) {
    float acc = 0.f;
    for (long r = 0; r < reps_per_unit; r++)
        for (int i = 0; i < WIDTH; i++) acc += data[i] * 1.0001f;
    sink = acc;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* The helper's protocol. `ticket` is (call << 32) | next unit: a take is a compare-and-swap that
 * fails for a helper still holding an older call's number, so a helper that wakes late takes
 * nothing of a later call. */
static _Atomic uint64_t ticket;
static _Atomic uint32_t posted; /* the latest call's number: the helper's futex word */
static _Atomic int finished;    /* units finished in the current call */
static _Atomic int sleeping;
static uint32_t calls_posted;

static int take(uint32_t call) {
    uint64_t t = atomic_load(&ticket);
    for (;;) {
        if ((uint32_t)(t >> 32) != call || (int)(t & 0xffffffffu) >= units) return -1;
        if (atomic_compare_exchange_weak(&ticket, &t, t + 1)) return (int)(t & 0xffffffffu);
    }
}

static void work(uint32_t call) {
    while (take(call) >= 0) {
        run_unit();
        atomic_fetch_add(&finished, 1);
    }
}

static void *helper(void *arg) {
    (void)arg;
    uint32_t seen = 0;
    for (;;) {
        uint32_t call;
        long spins = 0;
        while ((call = atomic_load(&posted)) == seen) {
            if (++spins < helper_spins) {
                _mm_pause();
                continue;
            }
            atomic_store(&sleeping, 1);
            if (atomic_load(&posted) == seen) syscall(SYS_futex, &posted, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
            atomic_store(&sleeping, 0);
            spins = 0;
        }
        seen = call;
        work(call);
    }
    return NULL;
}

static void call_helper(void) {
    uint32_t call = ++calls_posted;
    atomic_store(&finished, 0);
    atomic_store(&ticket, (uint64_t)call << 32);
    atomic_store(&posted, call);
    if (atomic_load(&sleeping)) syscall(SYS_futex, &posted, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
    work(call);
    while (atomic_load(&finished) < units) _mm_pause();
}

static void call_static(void) {
#pragma omp parallel num_threads(2)
    {
        int me = omp_get_thread_num();
        for (int u = units * me / 2; u < units * (me + 1) / 2; u++) run_unit();
    }
}

static void call_one(void) {
    for (int u = 0; u < units; u++) run_unit();
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s one|static|helper UNITS SECONDS REPS\n", argv[0]);
        return 2;
    }
    const char *mode = argv[1];
    units = atoi(argv[2]);
    double seconds = atof(argv[3]);
    long reps = atol(argv[4]);
    void (*call)(void) = !strcmp(mode, "one") ? call_one : !strcmp(mode, "static") ? call_static
                       : !strcmp(mode, "helper") ? call_helper : NULL;
    if (call == NULL || units < 1 || reps < units || seconds <= 0) {
        fprintf(stderr, "%s: expected a mode of one, static or helper, UNITS >= 1, REPS >= UNITS, SECONDS > 0\n", argv[0]);
        return 2;
    }
    reps_per_unit = reps / units;
    const char *spin = getenv("GOMP_SPINCOUNT");
    helper_spins = spin != NULL ? atol(spin) : 300000; /* libgomp's default */
    for (int i = 0; i < WIDTH; i++) data[i] = 1e-3f * (i % 7);
    if (call == call_helper) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, helper, NULL) != 0) return 1;
    }
    for (int i = 0; i < 200; i++) call();
    static double times[MAX_CALLS];
    long n = 0;
    double sum = 0, end = now() + seconds;
    while (n < MAX_CALLS && now() < end) {
        double t = now();
        call();
        times[n] = now() - t;
        sum += times[n++];
    }
    qsort(times, n, sizeof(double), by_value);
    printf("{\"median_s\": %.9f, \"mean_s\": %.9f, \"p99_s\": %.9f, \"calls\": %ld}\n", times[n / 2], sum / n, times[n * 99 / 100], n);
    return 0;
}
