package messaging_test

import (
	"strings"
	"testing"
	"time"

	messaging "settle.dev/messaging"
)

func TestAManifestIsTheSpecTheOperatorAdmitted(t *testing.T) {
	ns, s, err := messaging.SpecFromManifest([]byte(`apiVersion: messaging.settle.dev/v1alpha1
kind: Subscription
metadata: {name: orders, namespace: shop}
spec:
  backendRef: {name: nats}
  pattern: "orders.>"
  mode: AtLeastOnce
  durableName: orders
  maxDeliver: 5
  backoff: {initial: 1s, max: 1m}
  slowHandler: Redeliver
  ackWait: 45s
`))
	if err != nil {
		t.Fatal(err)
	}
	p := s.Resolve()
	if ns != "shop" || s.Name != "orders" || p.Mode != messaging.AtLeastOnce || p.MaxDeliver != 5 || p.DurableName != "orders" ||
		p.Backoff.Initial != time.Second || p.Backoff.Max != time.Minute || p.Backoff.Multiplier != 2 ||
		p.SlowHandler != messaging.Redeliver || p.AckWait != 45*time.Second || !s.OwnedByOperator {
		t.Fatalf("%s %+v", ns, p)
	}
	_, _, err = messaging.SpecFromManifest([]byte("kind: Subscription\nmetadata: {name: o}\nspec: {pattern: a, ackWait: soon}\n"))
	if err == nil || !strings.Contains(err.Error(), `spec.ackWait: "soon" is not a duration`) {
		t.Fatalf("a bad duration names its field: %v", err)
	}
}
