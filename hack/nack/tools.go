//go:build tools

package tools

import _ "github.com/nats-io/nack/cmd/jetstream-controller"
