/* launch: a bwrap sandbox's first host process. It joins the sandbox's cgroups, becomes the sandbox
 * user with no capabilities, then becomes bwrap: what `sh -c 'echo $$ > cgroup.procs...; exec "$@"'`
 * and `setpriv --reuid=UID --regid=GID --clear-groups --inh-caps=-all --bounding-set=-all` did in two
 * programs (a shell and a dynamically linked setpriv, about 2.8 ms of CPU a start on the shared
 * 2-core machine), in one small static program. sandboxes/launcher.py compiles it and builds its
 * argv; docs/benchmarks.md, "Issue 55, fifth session", says what it saves.
 *
 *     launch [-u UID -g GID] PROCS_FILE... -- /PATH/OF/PROGRAM ARG...
 *
 * Each PROCS_FILE (a cgroup's cgroup.procs) gets this process's pid, before anything else, so that
 * bwrap makes the sandbox's cgroup namespace where its cgroups are the root. With -u and -g (the
 * harness is root): every capability leaves the bounding set, the inheritable set is emptied,
 * the supplementary groups are cleared, then the real, effective and saved gid and uid become
 * GID and UID (which empties the permitted, effective and ambient sets). Any failure ends it with
 * status 125 and a line on stderr, before PROGRAM runs. Nothing here reads the environment.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

static void fail(const char *what, const char *arg) {
    fprintf(stderr, "launch: %s%s%s: %s\n", what, arg ? " " : "", arg ? arg : "", strerror(errno));
    _exit(125);
}

static long number(const char *text) {
    char *end;
    errno = 0;
    long value = strtol(text, &end, 10);
    if (errno || *text == '\0' || *end != '\0' || value < 0) {
        errno = EINVAL;
        fail("not a number:", text);
    }
    return value;
}

int main(int argc, char **argv) {
    long uid = -1, gid = -1;
    int i = 1;
    while (i + 1 < argc && (strcmp(argv[i], "-u") == 0 || strcmp(argv[i], "-g") == 0)) {
        if (argv[i][1] == 'u')
            uid = number(argv[i + 1]);
        else
            gid = number(argv[i + 1]);
        i += 2;
    }
    if ((uid < 0) != (gid < 0)) {
        errno = EINVAL;
        fail("-u and -g go together", NULL);
    }
    char pid[24];
    int pid_len = snprintf(pid, sizeof pid, "%d", (int)getpid());
    for (; i < argc && strcmp(argv[i], "--") != 0; i++) {
        int fd = open(argv[i], O_WRONLY | O_CLOEXEC);
        if (fd < 0 || write(fd, pid, pid_len) != pid_len)
            fail("cannot join the cgroup of", argv[i]);
        close(fd);
    }
    if (i + 1 >= argc) {
        errno = EINVAL;
        fail("no program after --", NULL);
    }
    if (uid >= 0) {
        /* the bounding set, while this process still has CAP_SETPCAP: every capability the kernel knows */
        for (int cap = 0; prctl(PR_CAPBSET_READ, cap, 0, 0, 0) >= 0; cap++)
            if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0)
                fail("cannot drop a capability from the bounding set", NULL);
        struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
        struct __user_cap_data_struct data[_LINUX_CAPABILITY_U32S_3];
        if (syscall(SYS_capget, &header, data) != 0)
            fail("capget", NULL);
        for (int k = 0; k < _LINUX_CAPABILITY_U32S_3; k++)
            data[k].inheritable = 0;
        if (syscall(SYS_capset, &header, data) != 0)
            fail("cannot empty the inheritable capabilities", NULL);
        if (setgroups(0, NULL) != 0)
            fail("setgroups", NULL);
        if (setresgid(gid, gid, gid) != 0)
            fail("setresgid", NULL);
        if (setresuid(uid, uid, uid) != 0)
            fail("setresuid", NULL);
        if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 && errno != EINVAL)
            fail("cannot clear the ambient capabilities", NULL);
    }
    execv(argv[i + 1], argv + i + 1);  /* a path: no search of $PATH */
    fail("cannot run", argv[i + 1]);
    return 125;
}
