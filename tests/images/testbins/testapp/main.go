// Command testapp is the local cluster's test workload (image stasis.local/testapp:dev):
//
//	testapp serve [ADDR]            HTTP server (default :8080): "/" answers "hello from <hostname>"
//	testapp get URL                 GET a URL, print the body (exit 1 unless 2xx)
//	testapp tcp HOST:PORT           connect, print what the server sends until it closes
//	testapp hostname                print the hostname
//	testapp s3put BUCKET KEY VALUE  PUT an object (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID,
//	testapp s3get BUCKET KEY        GET an object  AWS_SECRET_ACCESS_KEY; SigV4, path style)
//	testapp write PATH CONTENT      write a file (creating its directory)
//	testapp cat PATH                print a file
//	testapp sleep                   sleep forever
package main

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: testapp serve|get|tcp|hostname|s3put|s3get|sleep")
		os.Exit(2)
	}
	switch os.Args[1] {
	case "serve":
		addr := ":8080"
		if len(os.Args) > 2 {
			addr = os.Args[2]
		}
		serve(addr)
	case "get":
		resp, err := (&http.Client{Timeout: 10 * time.Second}).Get(os.Args[2])
		check(err)
		body, _ := io.ReadAll(resp.Body)
		fmt.Print(string(body))
		if resp.StatusCode/100 != 2 {
			fmt.Fprintln(os.Stderr, "status", resp.Status)
			os.Exit(1)
		}
	case "tcp":
		conn, err := net.DialTimeout("tcp", os.Args[2], 5*time.Second)
		check(err)
		check(conn.SetReadDeadline(time.Now().Add(10 * time.Second)))
		body, err := io.ReadAll(conn)
		check(err)
		fmt.Print(string(body))
	case "hostname":
		h, _ := os.Hostname()
		fmt.Println(h)
	case "s3put":
		body := s3(http.MethodPut, os.Args[2], os.Args[3], []byte(os.Args[4]))
		_ = body
		fmt.Println("ok")
	case "s3get":
		fmt.Print(string(s3(http.MethodGet, os.Args[2], os.Args[3], nil)))
	case "write":
		check(os.MkdirAll(filepath.Dir(os.Args[2]), 0o755))
		check(os.WriteFile(os.Args[2], []byte(os.Args[3]), 0o644))
	case "cat":
		b, err := os.ReadFile(os.Args[2])
		check(err)
		fmt.Print(string(b))
	case "sleep":
		waitSignal()
	default:
		fmt.Fprintln(os.Stderr, "unknown command", os.Args[1])
		os.Exit(2)
	}
}

func check(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "testapp:", err)
		os.Exit(1)
	}
}

func waitSignal() {
	c := make(chan os.Signal, 1)
	signal.Notify(c, syscall.SIGTERM, syscall.SIGINT)
	<-c
}

func serve(addr string) {
	host, _ := os.Hostname()
	http.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "hello from %s\n", host)
	})
	http.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) { fmt.Fprintln(w, "ok") })
	fmt.Printf("testapp serving on %s as %s\n", addr, host)
	go func() { check(http.ListenAndServe(addr, nil)) }()
	waitSignal()
	fmt.Println("testapp: stopping")
}

func hmacSHA(key []byte, data string) []byte {
	h := hmac.New(sha256.New, key)
	h.Write([]byte(data))
	return h.Sum(nil)
}

func sha(data []byte) string {
	s := sha256.Sum256(data)
	return hex.EncodeToString(s[:])
}

// s3 does one path-style request signed with AWS Signature Version 4.
func s3(method, bucket, key string, body []byte) []byte {
	endpoint := os.Getenv("AWS_ENDPOINT_URL")
	ak, sk := os.Getenv("AWS_ACCESS_KEY_ID"), os.Getenv("AWS_SECRET_ACCESS_KEY")
	region := os.Getenv("AWS_REGION")
	if region == "" {
		region = "us-east-1"
	}
	if endpoint == "" || ak == "" || sk == "" {
		check(fmt.Errorf("AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY must be set"))
	}
	u, err := url.Parse(strings.TrimRight(endpoint, "/") + "/" + bucket + "/" + key)
	check(err)
	now := time.Now().UTC()
	amzDate := now.Format("20060102T150405Z")
	day := now.Format("20060102")
	payloadHash := sha(body)
	canonHeaders := "host:" + u.Host + "\nx-amz-content-sha256:" + payloadHash + "\nx-amz-date:" + amzDate + "\n"
	signed := "host;x-amz-content-sha256;x-amz-date"
	canonReq := strings.Join([]string{method, u.EscapedPath(), "", canonHeaders, signed, payloadHash}, "\n")
	scope := day + "/" + region + "/s3/aws4_request"
	toSign := strings.Join([]string{"AWS4-HMAC-SHA256", amzDate, scope, sha([]byte(canonReq))}, "\n")
	k := hmacSHA([]byte("AWS4"+sk), day)
	k = hmacSHA(k, region)
	k = hmacSHA(k, "s3")
	k = hmacSHA(k, "aws4_request")
	sig := hex.EncodeToString(hmacSHA(k, toSign))
	req, err := http.NewRequest(method, u.String(), strings.NewReader(string(body)))
	check(err)
	req.ContentLength = int64(len(body))
	req.Header.Set("x-amz-date", amzDate)
	req.Header.Set("x-amz-content-sha256", payloadHash)
	req.Header.Set("Authorization", fmt.Sprintf("AWS4-HMAC-SHA256 Credential=%s/%s, SignedHeaders=%s, Signature=%s", ak, scope, signed, sig))
	resp, err := (&http.Client{Timeout: 20 * time.Second}).Do(req)
	check(err)
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	if resp.StatusCode/100 != 2 {
		check(fmt.Errorf("%s %s: %s: %s", method, u, resp.Status, out))
	}
	return out
}
