/* Preloaded into tritonserver and its Python stubs (ops/private_shm.py): an fchmod of a file under
 * /dev/shm keeps the owner's permission bits only. The Python backend creates each stub's region,
 * through which every client's tensors pass, with boost.interprocess, which fchmods it to 0644
 * right after creating it (whatever the umask): every local user could map it. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char shm_dir[] = "/dev/shm/";

int fchmod(int fd, mode_t mode) {
    static int (*real_fchmod)(int, mode_t);
    char link[32], target[4096];
    ssize_t length;

    if (real_fchmod == NULL) {
        real_fchmod = (int (*)(int, mode_t))dlsym(RTLD_NEXT, "fchmod");
        if (real_fchmod == NULL) {
            errno = ENOSYS;
            return -1;
        }
    }
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    length = readlink(link, target, sizeof target - 1);
    if (length > 0) {
        target[length] = '\0';
        if (strncmp(target, shm_dir, sizeof shm_dir - 1) == 0) {
            mode &= S_IRWXU;
        }
    }
    return real_fchmod(fd, mode);
}
