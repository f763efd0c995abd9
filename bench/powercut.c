/* What a power cut would leave of one file, recorded while a process writes it.

   Loaded with LD_PRELOAD into a process (bench/crash.py --power-cut builds it with the
   system's C compiler), it lets every write to the file named by ENGRAM_POWERCUT_FILE
   through and also appends it to the journal ENGRAM_POWERCUT_JOURNAL:

       'W' offset:u64 length:u32 bytes    a write that returned, in the order they returned
       'S' writes:u64                     an fsync/fdatasync of the file returned; it covers
                                          the first `writes` W records (those that had
                                          returned when it was called)
       'T' size:u64                       an ftruncate of the file returned

   A write through a descriptor opened with O_SYNC or O_DSYNC is journaled like any other:
   durable only once a later fsync covers it (an under-claim, never an over-claim; the engine
   opens no such descriptor). After a kill -9, bench/crash.py rebuilds the file a power cut at that moment could leave:
   every write a sync covered, and each page written after it as it stood at a random
   moment (the kernel writes dirty pages back whole, in no promised order across pages). Only the C library's write calls are
   seen: the file must not be written through a writable mmap (LMDB without MDB_WRITEMAP,
   as the engine opens it, writes with pwrite, pwritev and writev). */

#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int journal = -1;
static int resolved = 0;
static dev_t target_dev;
static ino_t target_ino;
static uint64_t writes = 0;

static ssize_t (*real_write)(int, const void *, size_t);
static ssize_t (*real_pwrite)(int, const void *, size_t, off_t);
static ssize_t (*real_pwrite64)(int, const void *, size_t, off_t);
static ssize_t (*real_writev)(int, const struct iovec *, int);
static ssize_t (*real_pwritev)(int, const struct iovec *, int, off_t);
static int (*real_fsync)(int);
static int (*real_fdatasync)(int);
static int (*real_ftruncate)(int, off_t);

__attribute__((constructor)) static void init(void) {
    real_write = dlsym(RTLD_NEXT, "write");
    real_pwrite = dlsym(RTLD_NEXT, "pwrite");
    real_pwrite64 = dlsym(RTLD_NEXT, "pwrite64");
    real_writev = dlsym(RTLD_NEXT, "writev");
    real_pwritev = dlsym(RTLD_NEXT, "pwritev");
    real_fsync = dlsym(RTLD_NEXT, "fsync");
    real_fdatasync = dlsym(RTLD_NEXT, "fdatasync");
    real_ftruncate = dlsym(RTLD_NEXT, "ftruncate");
    const char *path = getenv("ENGRAM_POWERCUT_JOURNAL");
    if (path != NULL)
        journal = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
}

/* Whether fd is the watched file (found by device and inode once it exists). */
static int watched(int fd) {
    if (journal < 0 || fd == journal)
        return 0;
    struct stat st;
    if (!__atomic_load_n(&resolved, __ATOMIC_ACQUIRE)) {
        const char *path = getenv("ENGRAM_POWERCUT_FILE");
        if (path == NULL || stat(path, &st) != 0)
            return 0;
        pthread_mutex_lock(&lock);
        target_dev = st.st_dev;
        target_ino = st.st_ino;
        __atomic_store_n(&resolved, 1, __ATOMIC_RELEASE);
        pthread_mutex_unlock(&lock);
    }
    if (fstat(fd, &st) != 0)
        return 0;
    return st.st_dev == target_dev && st.st_ino == target_ino;
}

static void put(const void *data, size_t n) {
    const char *p = data;
    while (n > 0) {
        ssize_t w = real_write(journal, p, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            abort(); /* a journal that lost a record would describe another file */
        }
        p += w;
        n -= (size_t)w;
    }
}

static void mark_sync(uint64_t covered) {
    char tag = 'S';
    put(&tag, 1);
    put(&covered, 8);
}

/* Journal n bytes written at offset (called with the lock held). */
static void record(uint64_t offset, const struct iovec *iov, int count, size_t n) {
    char tag = 'W';
    uint32_t length = (uint32_t)n;
    put(&tag, 1);
    put(&offset, 8);
    put(&length, 4);
    for (int i = 0; i < count && n > 0; i++) {
        size_t part = iov[i].iov_len < n ? iov[i].iov_len : n;
        put(iov[i].iov_base, part);
        n -= part;
    }
    writes++;
}

static void after_write(uint64_t offset, const struct iovec *iov, int count,
                        ssize_t done) {
    if (done <= 0)
        return;
    pthread_mutex_lock(&lock);
    record(offset, iov, count, (size_t)done);
    pthread_mutex_unlock(&lock);
}

ssize_t pwrite(int fd, const void *buf, size_t n, off_t offset) {
    ssize_t done = real_pwrite(fd, buf, n, offset);
    if (watched(fd)) {
        struct iovec one = {(void *)buf, n};
        after_write((uint64_t)offset, &one, 1, done);
    }
    return done;
}

ssize_t pwrite64(int fd, const void *buf, size_t n, off_t offset) {
    ssize_t done = real_pwrite64(fd, buf, n, offset);
    if (watched(fd)) {
        struct iovec one = {(void *)buf, n};
        after_write((uint64_t)offset, &one, 1, done);
    }
    return done;
}

ssize_t pwritev(int fd, const struct iovec *iov, int count, off_t offset) {
    ssize_t done = real_pwritev(fd, iov, count, offset);
    if (watched(fd))
        after_write((uint64_t)offset, iov, count, done);
    return done;
}

ssize_t write(int fd, const void *buf, size_t n) {
    if (!watched(fd))
        return real_write(fd, buf, n);
    off_t offset = lseek(fd, 0, SEEK_CUR);
    ssize_t done = real_write(fd, buf, n);
    struct iovec one = {(void *)buf, n};
    after_write((uint64_t)offset, &one, 1, done);
    return done;
}

ssize_t writev(int fd, const struct iovec *iov, int count) {
    if (!watched(fd))
        return real_writev(fd, iov, count);
    off_t offset = lseek(fd, 0, SEEK_CUR);
    ssize_t done = real_writev(fd, iov, count);
    after_write((uint64_t)offset, iov, count, done);
    return done;
}

static int synced(int fd, int (*real)(int)) {
    if (!watched(fd))
        return real(fd);
    pthread_mutex_lock(&lock);
    uint64_t covered = writes;
    pthread_mutex_unlock(&lock);
    int result = real(fd);
    if (result == 0) {
        pthread_mutex_lock(&lock);
        mark_sync(covered);
        pthread_mutex_unlock(&lock);
    }
    return result;
}

int fsync(int fd) { return synced(fd, real_fsync); }

int fdatasync(int fd) { return synced(fd, real_fdatasync); }

int ftruncate(int fd, off_t size) {
    int result = real_ftruncate(fd, size);
    if (result == 0 && watched(fd)) {
        pthread_mutex_lock(&lock);
        char tag = 'T';
        uint64_t value = (uint64_t)size;
        put(&tag, 1);
        put(&value, 8);
        pthread_mutex_unlock(&lock);
    }
    return result;
}
