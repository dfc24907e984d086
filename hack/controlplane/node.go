// The node's parts, for `hack/env.sh up --node`: the upstream kubelet, kube-proxy,
// kube-controller-manager and kube-scheduler from the same k8s.io/kubernetes release as the API
// server, dispatched on the first argument (`settle-controlplane kubelet --config=...`). Each is
// the real component's own command; nothing here changes what it does.
package main

import (
	"context"
	"os"

	"github.com/spf13/cobra"
	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	kcm "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	proxy "k8s.io/kubernetes/cmd/kube-proxy/app"
	sched "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"
)

// runComponent runs the node component `name` with `args` and exits with its code; false when
// `name` names none (the control plane's own flags follow).
func runComponent(name string, args []string) bool {
	var cmd *cobra.Command
	switch name {
	case "kubelet":
		cmd = kubelet.NewKubeletCommand(context.Background())
	case "kube-proxy":
		cmd = proxy.NewProxyCommand()
	case "kube-controller-manager":
		cmd = kcm.NewControllerManagerCommand()
	case "kube-scheduler":
		cmd = sched.NewSchedulerCommand()
	default:
		return false
	}
	cmd.SetArgs(args)
	os.Exit(cli.Run(cmd))
	return true
}
