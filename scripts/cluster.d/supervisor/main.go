// Command supervisor runs the local cluster's daemons the way systemd would on a real node:
// it is a child subreaper (it reaps every orphan below it: containerd shims double-fork),
// restarts a daemon that exits unless it was stopped, and restarts or kills daemons on request.
//
//	supervisor run --dir D                     # the daemon; control socket D/supervisor.sock
//	supervisor ctl --dir D start NAME          # start service D/services/NAME.json
//	supervisor ctl --dir D stop|restart NAME
//	supervisor ctl --dir D status
//	supervisor ctl --dir D kill-node PREFIX CGROUP...  # stop PREFIX* without restart, then
//	                                              # freeze and SIGKILL every task in the cgroups
//	supervisor ctl --dir D shutdown
//	supervisor exec-in [--cgroup DIR]... [--netns FILE] -- ARGV...   (internal)
//	supervisor cgkill CGROUP...                 # freeze+kill without a daemon
//
// A service file is JSON: {"argv": [...], "env": ["K=V"], "log": "path", "netns": "/run/netns/x",
// "cgroups": ["/sys/fs/cgroup/freezer/..."], "dir": "/"}.
package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"
)

type spec struct {
	Argv    []string `json:"argv"`
	Env     []string `json:"env"`
	Log     string   `json:"log"`
	Netns   string   `json:"netns"`
	Cgroups []string `json:"cgroups"`
	Dir     string   `json:"dir"`
	// PidFile, when set, receives the service's pid each time it starts.
	PidFile string `json:"pidfile"`
	// RestartTrigger, when set: creating this file asks for a restart (the file is removed),
	// the way `systemctl restart` would be used on a real node.
	RestartTrigger string `json:"restart_trigger"`
}

type service struct {
	name     string
	spec     spec
	pid      int
	want     bool // should be running
	restarts int
	started  time.Time
	order    int
	exited   chan struct{}
}

type supervisor struct {
	mu       sync.Mutex
	dir      string
	services map[string]*service
	byPid    map[int]*service
	seq      int
	logf     *os.File
}

func (s *supervisor) log(format string, a ...any) {
	fmt.Fprintf(s.logf, "%s %s\n", time.Now().UTC().Format(time.RFC3339), fmt.Sprintf(format, a...))
}

func main() {
	if len(os.Args) < 2 {
		usage()
	}
	switch os.Args[1] {
	case "run":
		run(flagDir(os.Args[2:]))
	case "ctl":
		dir := flagDir(os.Args[2:4])
		os.Exit(ctl(dir, os.Args[4:]))
	case "exec-in":
		execIn(os.Args[2:])
	case "cgkill":
		if err := cgKill(os.Args[2:]); err != nil {
			fmt.Fprintln(os.Stderr, "supervisor:", err)
			os.Exit(1)
		}
	default:
		usage()
	}
}

func usage() {
	fmt.Fprintln(os.Stderr, "usage: supervisor run --dir D | ctl --dir D CMD... | exec-in ... | cgkill CGROUP...")
	os.Exit(2)
}

func flagDir(a []string) string {
	if len(a) < 2 || a[0] != "--dir" {
		usage()
	}
	return a[1]
}

func run(dir string) {
	const prSetChildSubreaper = 36
	if _, _, e := syscall.RawSyscall(syscall.SYS_PRCTL, prSetChildSubreaper, 1, 0); e != 0 {
		fmt.Fprintln(os.Stderr, "supervisor: PR_SET_CHILD_SUBREAPER:", e)
		os.Exit(1)
	}
	lf, err := os.OpenFile(filepath.Join(dir, "supervisor.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		fmt.Fprintln(os.Stderr, "supervisor:", err)
		os.Exit(1)
	}
	s := &supervisor{dir: dir, services: map[string]*service{}, byPid: map[int]*service{}, logf: lf}
	sock := filepath.Join(dir, "supervisor.sock")
	os.Remove(sock)
	ln, err := net.Listen("unix", sock)
	if err != nil {
		s.log("listen: %v", err)
		os.Exit(1)
	}
	os.WriteFile(filepath.Join(dir, "supervisor.pid"), []byte(fmt.Sprintf("%d\n", os.Getpid())), 0o644)
	s.log("supervisor %d up", os.Getpid())

	sigs := make(chan os.Signal, 16)
	signal.Notify(sigs, syscall.SIGCHLD, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		for sig := range sigs {
			if sig == syscall.SIGCHLD {
				s.reap()
			} else {
				go s.shutdown(ln)
			}
		}
	}()
	// Periodic reap as a safety net (SIGCHLD may coalesce), and restart triggers.
	go func() {
		for range time.Tick(1 * time.Second) {
			s.reap()
			s.checkTriggers()
		}
	}()
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		go s.handle(c, ln)
	}
}

func (s *supervisor) reap() {
	for {
		var ws syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
		if pid <= 0 || err != nil {
			return
		}
		s.mu.Lock()
		svc := s.byPid[pid]
		if svc != nil {
			delete(s.byPid, pid)
			svc.pid = 0
			s.log("%s (pid %d) exited: %s", svc.name, pid, describe(ws))
			close(svc.exited)
			if svc.want {
				svc.restarts++
				delay := time.Duration(min(svc.restarts, 10)) * time.Second
				if time.Since(svc.started) > 30*time.Second {
					delay = time.Second
				}
				name := svc.name
				time.AfterFunc(delay, func() {
					s.mu.Lock()
					defer s.mu.Unlock()
					if sv := s.services[name]; sv != nil && sv.want && sv.pid == 0 {
						if err := s.startLocked(sv); err != nil {
							s.log("restart %s: %v", name, err)
						}
					}
				})
			}
		}
		s.mu.Unlock()
	}
}

func (s *supervisor) checkTriggers() {
	s.mu.Lock()
	var names []string
	for _, v := range s.services {
		if v.want && v.spec.RestartTrigger != "" {
			if _, err := os.Stat(v.spec.RestartTrigger); err == nil {
				os.Remove(v.spec.RestartTrigger)
				names = append(names, v.name)
			}
		}
	}
	s.mu.Unlock()
	for _, n := range names {
		s.log("restart of %s requested by its trigger file", n)
		if err := s.stop(n, 15*time.Second); err != nil {
			s.log("restart %s: %v", n, err)
		}
		if err := s.start(n); err != nil {
			s.log("restart %s: %v", n, err)
		}
	}
}

func describe(ws syscall.WaitStatus) string {
	if ws.Signaled() {
		return "signal " + ws.Signal().String()
	}
	return fmt.Sprintf("exit %d", ws.ExitStatus())
}

func (s *supervisor) loadSpec(name string) (spec, error) {
	var sp spec
	b, err := os.ReadFile(filepath.Join(s.dir, "services", name+".json"))
	if err != nil {
		return sp, err
	}
	if err := json.Unmarshal(b, &sp); err != nil {
		return sp, fmt.Errorf("%s: %v", name, err)
	}
	if len(sp.Argv) == 0 {
		return sp, fmt.Errorf("%s: empty argv", name)
	}
	return sp, nil
}

func (s *supervisor) startLocked(svc *service) error {
	self, err := os.Executable()
	if err != nil {
		return err
	}
	args := []string{self, "exec-in"}
	for _, c := range svc.spec.Cgroups {
		args = append(args, "--cgroup", c)
	}
	if svc.spec.Netns != "" {
		args = append(args, "--netns", svc.spec.Netns)
	}
	args = append(args, "--")
	args = append(args, svc.spec.Argv...)
	logPath := svc.spec.Log
	if logPath == "" {
		logPath = filepath.Join(s.dir, svc.name+".log")
	}
	lf, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer lf.Close()
	devnull, _ := os.Open(os.DevNull)
	defer devnull.Close()
	env := append(os.Environ(), svc.spec.Env...)
	dir := svc.spec.Dir
	if dir == "" {
		dir = "/"
	}
	p, err := os.StartProcess(self, args, &os.ProcAttr{
		Dir: dir, Env: env, Files: []*os.File{devnull, lf, lf},
		Sys: &syscall.SysProcAttr{Setpgid: true},
	})
	if err != nil {
		return err
	}
	svc.pid = p.Pid
	svc.started = time.Now()
	svc.exited = make(chan struct{})
	s.byPid[p.Pid] = svc
	p.Release()
	if svc.spec.PidFile != "" {
		os.MkdirAll(filepath.Dir(svc.spec.PidFile), 0o755)
		os.WriteFile(svc.spec.PidFile, []byte(fmt.Sprintf("%d\n", svc.pid)), 0o644)
	}
	s.log("started %s pid %d: %s", svc.name, svc.pid, strings.Join(svc.spec.Argv, " "))
	return nil
}

func (s *supervisor) start(name string) error {
	sp, err := s.loadSpec(name)
	if err != nil {
		return err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	svc := s.services[name]
	if svc == nil {
		s.seq++
		svc = &service{name: name, order: s.seq}
		s.services[name] = svc
	}
	svc.spec = sp
	svc.want = true
	if svc.pid != 0 {
		return nil
	}
	return s.startLocked(svc)
}

// stop signals the service's process group with SIGTERM, then SIGKILL after the grace period.
func (s *supervisor) stop(name string, grace time.Duration) error {
	s.mu.Lock()
	svc := s.services[name]
	if svc == nil {
		s.mu.Unlock()
		return nil
	}
	svc.want = false
	pid, exited := svc.pid, svc.exited
	s.mu.Unlock()
	if pid == 0 {
		return nil
	}
	syscall.Kill(pid, syscall.SIGTERM)
	select {
	case <-exited:
	case <-time.After(grace):
		syscall.Kill(-pid, syscall.SIGKILL)
		syscall.Kill(pid, syscall.SIGKILL)
		select {
		case <-exited:
		case <-time.After(5 * time.Second):
			return fmt.Errorf("%s (pid %d) did not exit", name, pid)
		}
	}
	return nil
}

func (s *supervisor) status() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var list []*service
	for _, v := range s.services {
		list = append(list, v)
	}
	sort.Slice(list, func(i, j int) bool { return list[i].order < list[j].order })
	var b strings.Builder
	for _, v := range list {
		state := "running"
		if v.pid == 0 {
			state = "stopped"
			if v.want {
				state = "restarting"
			}
		}
		fmt.Fprintf(&b, "%-28s %-10s pid=%-8d restarts=%d\n", v.name, state, v.pid, v.restarts)
	}
	return b.String()
}

func (s *supervisor) names(prefix string, reverse bool) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var list []*service
	for _, v := range s.services {
		if strings.HasPrefix(v.name, prefix) {
			list = append(list, v)
		}
	}
	sort.Slice(list, func(i, j int) bool { return (list[i].order < list[j].order) != reverse })
	var out []string
	for _, v := range list {
		out = append(out, v.name)
	}
	return out
}

func (s *supervisor) shutdown(ln net.Listener, killRoots ...string) {
	for _, n := range s.names("", true) {
		if err := s.stop(n, 10*time.Second); err != nil {
			s.log("stop %s: %v", n, err)
		}
	}
	// kill what is left in the given cgroups (shims, containers) while we still reap them
	if len(killRoots) > 0 {
		if err := cgKill(killRoots); err != nil {
			s.log("shutdown: %v", err)
		}
	}
	s.log("supervisor shutting down")
	ln.Close()
	os.Remove(filepath.Join(s.dir, "supervisor.sock"))
	// reap every child (orphans were reparented to us) until none is left
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		var ws syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
		if err == syscall.ECHILD {
			break
		}
		if pid <= 0 {
			time.Sleep(50 * time.Millisecond)
		}
	}
	os.Exit(0)
}

func (s *supervisor) handle(c net.Conn, ln net.Listener) {
	defer c.Close()
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return
	}
	f := strings.Fields(line)
	if len(f) == 0 {
		return
	}
	reply := func(err error, out string) {
		if err != nil {
			fmt.Fprintf(c, "ERR %v\n", err)
			return
		}
		fmt.Fprintf(c, "OK\n%s", out)
	}
	arg := func(i int) string {
		if i < len(f) {
			return f[i]
		}
		return ""
	}
	switch f[0] {
	case "start":
		reply(s.start(arg(1)), "")
	case "stop":
		reply(s.stop(arg(1), 15*time.Second), "")
	case "restart":
		if err := s.stop(arg(1), 15*time.Second); err != nil {
			reply(err, "")
			return
		}
		reply(s.start(arg(1)), "")
	case "status":
		reply(nil, s.status())
	case "kill-node":
		names := s.names(arg(1), false)
		s.mu.Lock()
		for _, n := range names {
			s.services[n].want = false
		}
		s.mu.Unlock()
		err := cgKill(f[2:])
		s.log("kill-node %s: %v", arg(1), err)
		reply(err, "")
	case "shutdown": // shutdown [CGROUP...]: stop all services, kill what is left in the cgroups
		reply(nil, "")
		c.Close()
		s.shutdown(ln, f[1:]...)
	default:
		reply(fmt.Errorf("unknown command %q", f[0]), "")
	}
}

func ctl(dir string, args []string) int {
	c, err := net.Dial("unix", filepath.Join(dir, "supervisor.sock"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "supervisor: not running:", err)
		return 3
	}
	defer c.Close()
	fmt.Fprintln(c, strings.Join(args, " "))
	r := bufio.NewReader(c)
	first, _ := r.ReadString('\n')
	rest, _ := r.ReadString(0)
	fmt.Print(rest)
	if strings.HasPrefix(first, "OK") {
		return 0
	}
	if args[0] == "shutdown" && first == "" {
		return 0
	}
	fmt.Fprintln(os.Stderr, "supervisor:", strings.TrimSpace(strings.TrimPrefix(first, "ERR ")))
	return 1
}

func execIn(a []string) {
	var cgroups []string
	netns := ""
	i := 0
	for ; i < len(a); i++ {
		switch a[i] {
		case "--cgroup":
			i++
			cgroups = append(cgroups, a[i])
		case "--netns":
			i++
			netns = a[i]
		case "--":
			i++
			goto done
		}
	}
done:
	argv := a[i:]
	fail := func(err error) {
		fmt.Fprintln(os.Stderr, "supervisor exec-in:", err)
		os.Exit(127)
	}
	for _, c := range cgroups {
		if err := os.MkdirAll(c, 0o755); err != nil {
			fail(err)
		}
		if err := os.WriteFile(filepath.Join(c, "cgroup.procs"), []byte(fmt.Sprint(os.Getpid())), 0o644); err != nil {
			fail(fmt.Errorf("join %s: %v", c, err))
		}
	}
	runtime.LockOSThread()
	if netns != "" {
		fd, err := syscall.Open(netns, syscall.O_RDONLY|syscall.O_CLOEXEC, 0)
		if err != nil {
			fail(err)
		}
		const cloneNewnet = 0x40000000
		if _, _, e := syscall.RawSyscall(sysSetns(), uintptr(fd), cloneNewnet, 0); e != 0 {
			fail(fmt.Errorf("setns %s: %v", netns, e))
		}
		syscall.Close(fd)
	}
	path, err := exec.LookPath(argv[0])
	if err != nil {
		fail(err)
	}
	fail(syscall.Exec(path, argv, os.Environ()))
}

// cgKill freezes each cgroup (v1 freezer: descendants freeze too), SIGKILLs every task in it and
// its descendants, thaws it and every descendant (a container paused on its own, such as a pod
// stasis holds after its checkpoint, stays frozen when only its parent thaws, and a frozen task
// does not die; a machine that loses its power keeps no frozen task) and waits until the tasks
// are gone.
func cgKill(roots []string) error {
	var errs []string
	for _, root := range roots {
		if _, err := os.Stat(root); err != nil {
			continue
		}
		state := filepath.Join(root, "freezer.state")
		_, ferr := os.Stat(state)
		frozen := ferr == nil
		if frozen {
			os.WriteFile(state, []byte("FROZEN"), 0o644)
			for i := 0; i < 50; i++ {
				b, _ := os.ReadFile(state)
				if strings.TrimSpace(string(b)) == "FROZEN" {
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
		}
		for round := 0; round < 100; round++ {
			n := 0
			filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
				if err != nil || !d.IsDir() {
					return nil
				}
				b, _ := os.ReadFile(filepath.Join(p, "tasks"))
				for _, f := range strings.Fields(string(b)) {
					var pid int
					fmt.Sscan(f, &pid)
					if pid > 1 && pid != os.Getpid() {
						syscall.Kill(pid, syscall.SIGKILL)
						n++
					}
				}
				return nil
			})
			if frozen && round == 0 {
				filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
					if err == nil && d.IsDir() {
						os.WriteFile(filepath.Join(p, "freezer.state"), []byte("THAWED"), 0o644)
					}
					return nil
				})
			}
			if n == 0 {
				break
			}
			time.Sleep(50 * time.Millisecond)
			if round == 99 {
				errs = append(errs, fmt.Sprintf("%s: %d tasks left", root, n))
			}
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("%s", strings.Join(errs, "; "))
	}
	return nil
}

func sysSetns() uintptr {
	if runtime.GOARCH == "arm64" {
		return 268
	}
	return 308 // amd64
}
