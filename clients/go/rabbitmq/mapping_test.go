package rabbitmq

import (
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	messaging "settle.dev/messaging"
)

func TestTheQueueIsTheOperators(t *testing.T) {
	if RoutingKey("orders.*.>") != "orders.*.#" {
		t.Fatal(RoutingKey("orders.*.>"))
	}
	p := messaging.SubscriptionSpec{Name: "orders", Pattern: "orders.>", Mode: messaging.AtLeastOnce, DurableName: "orders", MaxDeliver: 5}.Resolve()
	a := arguments("shop", "orders", p, "dlx", false)
	if a["x-queue-type"] != "quorum" || a["x-delivery-limit"] != int64(4) || a[OwnerArg] != "shop/orders" || a["x-dead-letter-exchange"] != "dlx" {
		t.Fatalf("%v", a)
	}
	if QueueName("shop", "in.voices", messaging.Policy{}) != "settle_shop_in_voices" {
		t.Fatal(QueueName("shop", "in.voices", messaging.Policy{}))
	}
}

func TestTheAttemptIsTheDeliveryCountPlusOne(t *testing.T) {
	for _, c := range []struct {
		d    amqp.Delivery
		want int
	}{
		{amqp.Delivery{Headers: amqp.Table{"x-delivery-count": int64(2)}}, 3},
		{amqp.Delivery{Redelivered: true}, 2},
		{amqp.Delivery{}, 1},
	} {
		if got := attempt(c.d); got != c.want {
			t.Errorf("%v: %d, want %d", c.d.Headers, got, c.want)
		}
	}
}
