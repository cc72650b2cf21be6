/*
 * Preloaded in front of libfaketime: LD_PRELOAD="<this .so>:libfaketime.so.1",
 * always together with FAKETIME_DONT_FAKE_MONOTONIC=1.
 *
 * In that mode only the wall clock is faked, yet libfaketime 0.9.10 still
 * rewrites two kinds of waits on the monotonic clock as if they were faked
 * wall-clock deadlines:
 *
 *   clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, ...): fails with EINVAL or
 *     sleeps the wrong time (upstream issue 426). CPython >= 3.11 implements
 *     time.sleep() with exactly this call.
 *   pthread_cond_timedwait() on a condvar set to CLOCK_MONOTONIC: times out at
 *     once. CPython's GIL waits this way, so under the preload two busy threads
 *     swap the GIL hundreds of times more often than the 5 ms switch interval
 *     allows.
 *
 * Both calls go straight to the C library / kernel here when the clock is a
 * monotonic one. Everything else is handed on to the next definition, i.e.
 * libfaketime's, which turns faked wall-clock deadlines into real ones.
 * Linux + glibc >= 2.30 only (pthread_cond_clockwait, condvar clock bit).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if !defined(__GLIBC__) || !__GLIBC_PREREQ(2, 30)
#error "faketime_shim needs glibc >= 2.30"
#endif

/* glibc keeps a condvar's clock in bit 1 of __wrefs (nptl, since 2.25). */
#define COND_CLOCK_MONOTONIC_BIT 2u

typedef int (*clock_nanosleep_fn)(clockid_t, int, const struct timespec *, struct timespec *);
typedef int (*cond_timedwait_fn)(pthread_cond_t *, pthread_mutex_t *, const struct timespec *);

/* Looked up on first use; threads racing here all store the same pointer. */
static void *next_definition(const char *name)
{
    return dlsym(RTLD_NEXT, name);
}

int clock_nanosleep(clockid_t clock_id, int flags, const struct timespec *request,
                    struct timespec *remain)
{
    static clock_nanosleep_fn next;

    if (clock_id == CLOCK_MONOTONIC || clock_id == CLOCK_MONOTONIC_RAW
        || clock_id == CLOCK_BOOTTIME) {
        /* Reports errors by return value, like glibc's, and leaves errno alone. */
        int saved_errno = errno;
        int result = syscall(SYS_clock_nanosleep, clock_id, flags, request, remain) == 0 ? 0 : errno;
        errno = saved_errno;
        return result;
    }
    if (next == NULL && (next = (clock_nanosleep_fn)next_definition("clock_nanosleep")) == NULL)
        return ENOSYS;
    return next(clock_id, flags, request, remain);
}

int pthread_cond_timedwait(pthread_cond_t *cond, pthread_mutex_t *mutex,
                           const struct timespec *abstime)
{
    static cond_timedwait_fn next;

    if (__atomic_load_n(&cond->__data.__wrefs, __ATOMIC_RELAXED) & COND_CLOCK_MONOTONIC_BIT)
        return pthread_cond_clockwait(cond, mutex, CLOCK_MONOTONIC, abstime);
    if (next == NULL
        && (next = (cond_timedwait_fn)next_definition("pthread_cond_timedwait")) == NULL)
        return ENOSYS;
    return next(cond, mutex, abstime);
}
