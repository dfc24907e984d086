// settle-controlplane runs a real Kubernetes control plane for Settle's tests and demo: an
// embedded etcd and kube-apiserver (the upstream code, pinned in go.mod) in one process, bound to
// 127.0.0.1 only, or with -node-ip to the node's bridge address so that pods reach it. It writes
// its own PKI and an admin kubeconfig under -dir. The same binary also runs the node's parts
// (node.go: kubelet, kube-proxy, kube-controller-manager, kube-scheduler). It is not a
// simulator: it must never stub an API, it only starts the real ones.
package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"flag"
	"fmt"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
)

// nodeIP is the bridge address the API server binds and advertises with -node-ip; empty: 127.0.0.1.
var nodeIP string

func main() {
	if len(os.Args) > 1 && runComponent(os.Args[1], os.Args[2:]) {
		return
	}
	dir := flag.String("dir", "", "state directory (PKI, etcd data, kubeconfig, logs)")
	apiPort := flag.Int("apiserver-port", 0, "kube-apiserver secure port on 127.0.0.1")
	etcdPort := flag.Int("etcd-port", 0, "etcd client port on 127.0.0.1")
	etcdPeerPort := flag.Int("etcd-peer-port", 0, "etcd peer port on 127.0.0.1")
	flag.StringVar(&nodeIP, "node-ip", "", "serve the API on this local address (the node's bridge) instead of 127.0.0.1, publish it as the `kubernetes` Service's endpoint, and let the API server reach kubelets")
	flag.Parse()
	if *dir == "" || *apiPort == 0 || *etcdPort == 0 || *etcdPeerPort == 0 {
		fmt.Fprintln(os.Stderr, "usage: settle-controlplane -dir DIR -apiserver-port N -etcd-port N -etcd-peer-port N")
		os.Exit(2)
	}
	if err := run(*dir, *apiPort, *etcdPort, *etcdPeerPort); err != nil {
		fmt.Fprintln(os.Stderr, "settle-controlplane:", err)
		os.Exit(1)
	}
}

func run(dir string, apiPort, etcdPort, etcdPeerPort int) error {
	pki := filepath.Join(dir, "pki")
	if err := os.MkdirAll(pki, 0o700); err != nil {
		return err
	}
	if err := writePKI(pki); err != nil {
		return fmt.Errorf("pki: %w", err)
	}
	if err := writeKubeconfig(dir, pki, apiPort); err != nil {
		return fmt.Errorf("kubeconfig: %w", err)
	}

	etcd, err := startEtcd(filepath.Join(dir, "etcd"), etcdPort, etcdPeerPort)
	if err != nil {
		return fmt.Errorf("etcd: %w", err)
	}
	defer etcd.Close()

	cmd := app.NewAPIServerCommand()
	args := []string{
		fmt.Sprintf("--etcd-servers=http://127.0.0.1:%d", etcdPort),
		fmt.Sprintf("--secure-port=%d", apiPort),
		"--cert-dir=" + filepath.Join(dir, "apiserver-certs"),
		"--tls-cert-file=" + filepath.Join(pki, "apiserver.crt"),
		"--tls-private-key-file=" + filepath.Join(pki, "apiserver.key"),
		"--client-ca-file=" + filepath.Join(pki, "ca.crt"),
		"--service-account-issuer=https://kubernetes.default.svc",
		"--service-account-key-file=" + filepath.Join(pki, "sa.key"),
		"--service-account-signing-key-file=" + filepath.Join(pki, "sa.key"),
		"--service-cluster-ip-range=10.96.0.0/16",
		"--authorization-mode=RBAC",
		"--enable-admission-plugins=ValidatingAdmissionWebhook,MutatingAdmissionWebhook",
		"--profiling=false",
		"--v=0",
	}
	if nodeIP == "" {
		args = append(args, "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
			"--endpoint-reconciler-type=none") // a loopback address may not be published as an endpoint
	} else {
		args = append(args, "--bind-address="+nodeIP, "--advertise-address="+nodeIP,
			// The API server calls kubelets (logs, exec) with the admin certificate, by the node's
			// InternalIP: the default tries the Hostname first, a lookup in the machine's resolver.
			"--kubelet-client-certificate="+filepath.Join(pki, "admin.crt"),
			"--kubelet-client-key="+filepath.Join(pki, "admin.key"),
			"--kubelet-preferred-address-types=InternalIP",
			// Webhooks registered by `service:` are dialled at the endpoint pod's IP, not through
			// the ClusterIP: admission does not depend on kube-proxy.
			"--enable-aggregator-routing=true")
	}
	cmd.SetArgs(args)
	return cmd.Execute()
}

func startEtcd(dataDir string, clientPort, peerPort int) (*embed.Etcd, error) {
	cfg := embed.NewConfig()
	cfg.Name = "settle"
	cfg.Dir = dataDir
	client := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", clientPort)}
	peer := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", peerPort)}
	cfg.ListenClientUrls = []url.URL{client}
	cfg.AdvertiseClientUrls = []url.URL{client}
	cfg.ListenPeerUrls = []url.URL{peer}
	cfg.AdvertisePeerUrls = []url.URL{peer}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.LogLevel = "error"
	cfg.LogOutputs = []string{filepath.Join(filepath.Dir(dataDir), "etcd.log")}
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return nil, err
	}
	select {
	case <-e.Server.ReadyNotify():
		return e, nil
	case <-time.After(60 * time.Second):
		e.Close()
		return nil, fmt.Errorf("not ready after 60s")
	}
}

// writePKI creates a CA, the API server's serving certificate, an admin client certificate in
// system:masters, and the service-account key, once; later starts reuse them so kubeconfigs and
// caBundles stay valid across restarts.
func writePKI(pki string) error {
	if _, err := os.Stat(filepath.Join(pki, "admin.crt")); err == nil {
		return nil
	}
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "settle-test-ca"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(10 * 365 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return err
	}
	caCert, err := x509.ParseCertificate(caDER)
	if err != nil {
		return err
	}
	if err := writeCertKey(pki, "ca", caDER, caKey); err != nil {
		return err
	}
	leaf := func(name string, serial int64, subject pkix.Name, usage x509.ExtKeyUsage, dns []string, ips []net.IP) error {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return err
		}
		tmpl := &x509.Certificate{
			SerialNumber: big.NewInt(serial),
			Subject:      subject,
			NotBefore:    time.Now().Add(-time.Hour),
			NotAfter:     time.Now().Add(10 * 365 * 24 * time.Hour),
			KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
			ExtKeyUsage:  []x509.ExtKeyUsage{usage},
			DNSNames:     dns,
			IPAddresses:  ips,
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, caCert, &key.PublicKey, caKey)
		if err != nil {
			return err
		}
		return writeCertKey(pki, name, der, key)
	}
	if err := leaf("apiserver", 2, pkix.Name{CommonName: "kube-apiserver"}, x509.ExtKeyUsageServerAuth,
		[]string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"},
		apiserverIPs()); err != nil {
		return err
	}
	saKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(pki, "sa.key"), pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(saKey)}), 0o600); err != nil {
		return err
	}
	// admin.crt last: its presence marks a complete PKI.
	return leaf("admin", 3, pkix.Name{CommonName: "settle-admin", Organization: []string{"system:masters"}}, x509.ExtKeyUsageClientAuth, nil, nil)
}

func writeCertKey(dir, name string, der []byte, key *ecdsa.PrivateKey) error {
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, name+".key"), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, name+".crt"), pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644)
}

func writeKubeconfig(dir, pki string, apiPort int) error {
	cfg := fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: settle-test
  cluster:
    server: https://%s:%d
    certificate-authority: %s
users:
- name: settle-admin
  user:
    client-certificate: %s
    client-key: %s
contexts:
- name: settle-test
  context: {cluster: settle-test, user: settle-admin}
current-context: settle-test
`, serveIP(), apiPort, filepath.Join(pki, "ca.crt"), filepath.Join(pki, "admin.crt"), filepath.Join(pki, "admin.key"))
	return os.WriteFile(filepath.Join(dir, "kubeconfig"), []byte(cfg), 0o600)
}

// serveIP is the address the API server serves on and the kubeconfig names.
func serveIP() string {
	if nodeIP != "" {
		return nodeIP
	}
	return "127.0.0.1"
}

// apiserverIPs are the serving certificate's IP SANs: loopback, the `kubernetes` Service's
// ClusterIP, and the node's address when there is one.
func apiserverIPs() []net.IP {
	ips := []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP("10.96.0.1")}
	if nodeIP != "" {
		ips = append(ips, net.ParseIP(nodeIP))
	}
	return ips
}
