// Command pause is the pod sandbox's pause process: it sleeps until told to stop and reaps
// any zombie that is handed to it (it is PID 1 of the pod's PID namespace when one is shared).
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range sigs {
		if s == syscall.SIGCHLD {
			for {
				var ws syscall.WaitStatus
				if pid, _ := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil); pid <= 0 {
					break
				}
			}
			continue
		}
		os.Exit(0)
	}
}
