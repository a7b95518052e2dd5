package main

// testapp request [--bearer FILE] METHOD URL [BODY-FILE|-]
//
// The HTTP client of the e2e security test (tests/e2e/security.sh), which plays a pod on the
// cluster network without credentials: it sends one request (the body from a file, or stdin
// with "-"; JSON), prints the response body on stdout and "status <code>" on stderr, and exits
// 0 whenever a response came back (the test judges the answer), 1 when none did (the error,
// such as a refused TLS handshake, on stderr). HTTPS does not verify the server: the attacker
// does not care whom it talks to. --bearer FILE sends FILE's content as a bearer token (such as
// the pod's projected service account token).
//
// It hooks in through init (before main's own dispatch) so that the other subcommands' file is
// left as it is.

import (
	"bytes"
	"crypto/tls"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"time"
)

func init() {
	if len(os.Args) < 2 || os.Args[1] != "request" {
		return
	}
	args, bearer := os.Args[2:], ""
	if len(args) > 1 && args[0] == "--bearer" {
		bearer, args = args[1], args[2:]
	}
	if len(args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: testapp request [--bearer FILE] METHOD URL [BODY-FILE|-]")
		os.Exit(2)
	}
	os.Exit(request(args[0], args[1], args[2:], bearer))
}

func request(method, url string, rest []string, bearer string) int {
	var body []byte
	if len(rest) > 0 {
		var err error
		if rest[0] == "-" {
			body, err = io.ReadAll(os.Stdin)
		} else {
			body, err = os.ReadFile(rest[0])
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "testapp request: reading the body:", err)
			return 1
		}
	}
	req, err := http.NewRequest(method, url, bytes.NewReader(body))
	if err != nil {
		fmt.Fprintln(os.Stderr, "testapp request:", err)
		return 1
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	if bearer != "" {
		t, err := os.ReadFile(bearer)
		if err != nil {
			fmt.Fprintln(os.Stderr, "testapp request: reading the bearer token:", err)
			return 1
		}
		req.Header.Set("Authorization", "Bearer "+strings.TrimSpace(string(t)))
	}
	client := &http.Client{
		Timeout:   20 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}},
	}
	resp, err := client.Do(req)
	if err != nil {
		fmt.Fprintln(os.Stderr, "testapp request:", err)
		return 1
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	os.Stdout.Write(out)
	if len(out) > 0 && out[len(out)-1] != '\n' {
		fmt.Println() // the status line that follows on stderr starts a line of its own
	}
	fmt.Fprintln(os.Stderr, "status", resp.StatusCode)
	return 0
}
